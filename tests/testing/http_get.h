// A blocking HTTP GET for tests (libcurl): the status code (0 when the request failed) and body.
#pragma once

#include <curl/curl.h>

#include <string>
#include <utility>

namespace dta::testing {

inline std::pair<long, std::string> HttpGet(const std::string& url,
                                            const std::string& bearer_token = "") {
  std::string body;
  CURL* curl = curl_easy_init();
  if (curl == nullptr) return {0, ""};
  curl_slist* headers = nullptr;
  if (!bearer_token.empty())
    headers = curl_slist_append(headers, ("Authorization: Bearer " + bearer_token).c_str());
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT, 10L);
  curl_easy_setopt(curl, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(
      curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t count, void* out) {
        static_cast<std::string*>(out)->append(data, size * count);
        return size * count;
      });
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
  long status = 0;
  if (curl_easy_perform(curl) == CURLE_OK) curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  return {status, body};
}

}  // namespace dta::testing
