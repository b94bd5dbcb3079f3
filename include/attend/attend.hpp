// attend/attend.hpp: everything public in one include.
#pragma once

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "attend/sdpa.hpp"
#include "attend/tensor.hpp"
