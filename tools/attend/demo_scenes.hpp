// demo_scenes.hpp: the four scenes of `attend demo`. Each builds its (seeded, untrained)
// modules and inputs, runs them, prints shapes, timings and per-head summaries to `out`, and
// returns its picture as SVG text; nothing is written to disk here. One file per scene
// (demo_phrase, demo_unet, demo_vit, demo_translation), their shared helpers in demo_common.
#pragma once

#include <ostream>
#include <string>

namespace attend::cli {

struct DemoSettings {
  int num_threads = 0;  // 0: the library default
};

struct DemoPicture {
  std::string file_name;  // e.g. "phrase_self_attention.svg"
  std::string svg;
};

// 1. "How are you?": token embeddings + sinusoidal positions, MultiHeadAttention(256, 8).
DemoPicture run_phrase_scene(const DemoSettings& settings, std::ostream& out);
// 2. A U-Net attention block: SpatialSelfAttention(128 channels, 4 heads) on (1, 128, 64, 64).
DemoPicture run_unet_scene(const DemoSettings& settings, std::ostream& out);
// 3. A vision transformer front: 8 × 8 patches of a (1, 3, 32, 32) image, class token, MHA.
DemoPicture run_vit_scene(const DemoSettings& settings, std::ostream& out);
// 4. Encoder-decoder: "Wie geht es dir" -> "How are you", with cross-attention.
DemoPicture run_translation_scene(const DemoSettings& settings, std::ostream& out);

}  // namespace attend::cli
