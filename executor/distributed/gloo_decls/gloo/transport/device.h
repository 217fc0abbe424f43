// Declaration-only stand-in for Gloo's gloo/transport/device.h (executor/distributed/
// gloo_backend.cc says why). ProcessGroupGloo.hpp holds the device and the buffers only through
// smart pointers.
#pragma once

namespace gloo::transport {

class Device;
class UnboundBuffer;

}  // namespace gloo::transport
