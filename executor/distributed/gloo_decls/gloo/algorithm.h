// Declaration-only stand-in for Gloo's gloo/algorithm.h (executor/distributed/gloo_backend.cc
// says why).
#pragma once

#include "gloo/context.h"
