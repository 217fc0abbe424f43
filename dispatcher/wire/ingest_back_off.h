// How the dispatcher asks an Ingest stream to back off, shared by the service and its clients (the
// C++ RolloutSender; the Python client repeats the prefix in dta/client.py).
//
// When the memory the dispatcher holds for received trajectories not yet stored, or the number of
// open Ingest streams, is at its limit (dispatcher/service/dispatcher_service.h), the stream ends
// with RESOURCE_EXHAUSTED and a message starting with kIngestBackOffPrefix; nothing after the last
// acknowledgement was stored, and a client resends it after backing off. gRPC's own
// RESOURCE_EXHAUSTED ("Received message larger than max"), which a resend can never fix, does not
// start with it.
#pragma once

namespace dta {

inline constexpr char kIngestBackOffPrefix[] = "Ingest: ";

}  // namespace dta
