// train_plot.hpp: the training curves of `attend train-demo` as an SVG picture, and writing a
// text file atomically.
#pragma once

#include <string>

#include "train_reverse.hpp"

namespace attend::cli {

// Two panels over the training steps: the training loss (per step, log scale) and the
// held-out loss above, the held-out token and sequence accuracy (%) below. Axes, ticks, labels
// and a legend are separate SVG elements.
std::string training_curves_svg(const examples::ReverseTaskSettings& settings,
                                const examples::TrainingHistory& history);

}  // namespace attend::cli
