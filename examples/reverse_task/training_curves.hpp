// training_curves.hpp: the loss and accuracy curves of a training run (train_reverse.hpp) as
// an SVG picture, drawn by examples/train_reverse.cpp and `attend train-demo`.
#pragma once

#include <string>

#include "train_reverse.hpp"

namespace attend::examples {

// Two panels over the training steps: the training loss (per step, log scale) and the
// held-out loss above, the held-out token and sequence accuracy (%) below. Axes, ticks, labels
// and a legend are separate SVG elements.
std::string training_curves_svg(const ReverseTaskSettings& settings,
                                const TrainingHistory& history);

}  // namespace attend::examples
