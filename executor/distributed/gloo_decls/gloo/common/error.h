// Declaration-only stand-in for Gloo's gloo/common/error.h (executor/distributed/gloo_backend.cc
// says why): ProcessGroupGloo.hpp includes it but names nothing from it.
#pragma once
