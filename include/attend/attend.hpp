// attend/attend.hpp: everything public in one include.
#pragma once

#include "attend/error.hpp"
#include "attend/kv_cache.hpp"
#include "attend/multihead.hpp"
#include "attend/npy.hpp"
#include "attend/plan.hpp"
#include "attend/positional.hpp"
#include "attend/rope.hpp"
#include "attend/runtime.hpp"
#include "attend/safetensors.hpp"
#include "attend/score_mod.hpp"
#include "attend/score_rules.hpp"
#include "attend/sdpa.hpp"
#include "attend/sdpa_backward.hpp"
#include "attend/spatial.hpp"
#include "attend/tensor.hpp"
#include "attend/varlen.hpp"
