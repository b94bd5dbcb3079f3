// ring_shards.hpp: one rank's shard of a whole float32 (..., L, D) tensor, the rows of the
// sequence dimension (rank − 2) that attend/mpi/ring.hpp's shard_pieces give it, and back.
// `attend ring` and `attend bench --ring` share them.
#pragma once

#include <vector>

#include "attend/mpi/ring.hpp"
#include "attend/tensor.hpp"

namespace attend::cli {

// Rows [offset, offset + length) of each piece, concatenated in the pieces' order.
Tensor gather_rows(const TensorView& whole, const std::vector<mpi::ShardPiece>& pieces);
// The reverse: the shard's rows written back to their places in `whole`.
void scatter_rows(const TensorView& shard, const std::vector<mpi::ShardPiece>& pieces,
                  const TensorView& whole);

}  // namespace attend::cli
