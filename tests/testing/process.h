// Child processes for end-to-end tests: start a binary with its output in a log file, kill it,
// wait for it with a timeout.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace dta::testing {

// The build's bin/ directory, next to the tests' directory (build/tests, build/bin).
inline std::filesystem::path BinaryDirectory() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().parent_path() / "bin";
}

class Process {
 public:
  // Starts args[0] with `args` and extra environment variables ("NAME=value"), stdout and stderr
  // appended to `log`.
  Process(const std::vector<std::string>& args, const std::string& log,
          const std::vector<std::string>& environment = {})
      : log_(log) {
    pid_ = fork();
    if (pid_ == 0) {
      for (const std::string& variable : environment) putenv(const_cast<char*>(variable.c_str()));
      FILE* out = std::fopen(log.c_str(), "a");
      if (out != nullptr) {
        dup2(fileno(out), STDOUT_FILENO);
        dup2(fileno(out), STDERR_FILENO);
      }
      std::vector<char*> argv;
      for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    if (running()) {
      Kill(SIGKILL);
      Wait(std::chrono::seconds(10));
    }
  }

  bool running() const { return pid_ > 0 && !exited_; }
  void Kill(int signal) {
    if (running()) kill(pid_, signal);
  }
  // The exit status (128 + signal when killed), or -1 if it is still running after `timeout`.
  int Wait(std::chrono::milliseconds timeout) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    while (running()) {
      int status = 0;
      const pid_t done = waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        exited_ = true;
        status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (std::chrono::steady_clock::now() >= give_up) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return status_;
  }
  // The log so far.
  std::string Log() const { return ReadLog(log_); }
  static std::string ReadLog(const std::filesystem::path& path) {
    std::ifstream in(path);
    std::stringstream buffer;
    buffer << in.rdbuf();
    return buffer.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
};

}  // namespace dta::testing
