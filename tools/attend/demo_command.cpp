// demo_command.cpp: `attend demo [--out-dir DIR] [--threads T]`.
//
// Creates the output directory first (a bad --out-dir fails before any work), runs the four
// scenes (demo_scenes.hpp), which print to stdout and return their pictures, then writes the
// pictures all-or-nothing: every temporary file first, the renames last.
#include "demo_command.hpp"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "attend/error.hpp"
#include "attend/runtime.hpp"
#include "demo_scenes.hpp"
#include "staged_text_file.hpp"

namespace attend::cli {
namespace {

namespace fs = std::filesystem;

struct DemoArguments {
  std::string out_dir = "attend-demo";
  std::string threads_text;
};

// Creates `directory` (and its parents) unless it exists; throws naming --out-dir otherwise.
void prepare_out_dir(const std::string& directory) {
  if (directory.empty()) throw Error("--out-dir: empty path");
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) {
    throw Error("--out-dir " + directory + ": cannot create directory: " + error.message());
  }
  if (!fs::is_directory(directory, error)) {
    throw Error("--out-dir " + directory + ": exists and is not a directory");
  }
}

void run_demo(const DemoArguments& arguments, const CLI::App& demo) {
  DemoSettings settings;
  settings.num_threads = threads_from(demo, arguments.threads_text, 0);
  const std::string simd_target = active_simd_target();  // throws for a bad ATTEND_MAX_SIMD
  prepare_out_dir(arguments.out_dir);

  const int threads = settings.num_threads > 0 ? settings.num_threads : default_num_threads();
  std::cout << "attend demo: scaled dot-product attention, softmax(Q·Kᵀ/sqrt(d_k))·V, four ways"
            << " (SIMD target " << simd_target << ", " << threads << " threads)\n"
            << "Every weight below comes from a deterministic seeded initialization, not from "
               "training,\nso the patterns show how attention is computed and masked, not "
               "learned meaning.\nNothing is downloaded: no network, no pretrained weights.\n\n";
  const auto start = std::chrono::steady_clock::now();
  std::vector<DemoPicture> pictures;
  pictures.push_back(run_phrase_scene(settings, std::cout));
  std::cout << '\n';
  pictures.push_back(run_unet_scene(settings, std::cout));
  std::cout << '\n';
  pictures.push_back(run_vit_scene(settings, std::cout));
  std::cout << '\n';
  pictures.push_back(run_translation_scene(settings, std::cout));
  const double elapsed =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  std::vector<std::unique_ptr<support::StagedTextFile>> staged;
  std::vector<std::string> paths;
  for (const DemoPicture& picture : pictures) {
    paths.push_back((fs::path(arguments.out_dir) / picture.file_name).string());
    staged.push_back(
        std::make_unique<support::StagedTextFile>("--out-dir", paths.back(), picture.svg));
  }
  for (auto& file : staged) file->commit();
  std::cout << "\nAll four scenes in " << static_cast<int64_t>(elapsed + 0.5) << " ms; "
            << wrote(paths) << '\n';
}

}  // namespace

Command add_demo_command(CLI::App& app) {
  auto arguments = std::make_shared<DemoArguments>();
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Attention on \"How are you?\", a U-Net feature map, image patches and a translation; "
      "prints shapes, timings and per-head summaries, writes SVG pictures of the weights");
  demo->add_option("--out-dir", arguments->out_dir,
                   "directory for the SVG pictures (created if missing; default attend-demo)")
      ->type_name("DIR");
  add_threads_option(*demo, arguments->threads_text, "all");
  return {demo, [arguments, demo] { run_demo(*arguments, *demo); }};
}

}  // namespace attend::cli
