// staged_file_test: the library's one atomic file writer (src/io/staged_file.hpp) and the
// writers built on it (write_npy, save_safetensors): the target changes only on commit, whole;
// every failure removes the temporary file and names the path; threads and processes writing
// one path at once leave exactly one writer's complete file and no temporary file.
#include "io/staged_file.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "attend/error.hpp"
#include "attend/npy.hpp"
#include "attend/safetensors.hpp"
#include "test_support.hpp"

namespace attend::detail {
namespace {

namespace fs = std::filesystem;
using test::read_file_bytes;
using test::TemporaryDirectory;
using test::write_file_bytes;

// The message of the Error that `call` throws ("" when it throws none).
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(StagedFile, TargetChangesOnlyOnCommit) {
  const TemporaryDirectory directory;
  const std::string path = directory / "out.bin";
  write_file_bytes(path, "old");
  StagedFile file(path);
  file.write("new ");
  file.write(std::string(100'000, 'x'));
  EXPECT_EQ(read_file_bytes(path), "old");
  EXPECT_EQ(directory.listing().size(), 2u);  // the target and the temporary file
  file.commit();
  EXPECT_EQ(read_file_bytes(path), "new " + std::string(100'000, 'x'));
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"out.bin"});
  file.commit();  // a second commit does nothing
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"out.bin"});
  struct stat status {};
  ASSERT_EQ(::stat(path.c_str(), &status), 0);
  EXPECT_EQ(status.st_mode & 0777, 0644u);
}

TEST(StagedFile, AnUncommittedFileLeavesNothing) {
  const TemporaryDirectory directory;
  const std::string path = directory / "out.bin";
  write_file_bytes(path, "old");
  {
    StagedFile file(path);
    file.write("new");
    file.flush();
  }
  EXPECT_EQ(read_file_bytes(path), "old");
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"out.bin"});
}

TEST(StagedFile, ErrorsNameThePathAndTheReason) {
  const TemporaryDirectory directory;
  const std::string missing = directory / "no/out.bin";
  EXPECT_EQ(
      error_of([&] { StagedFile file(missing); }),
      missing + ": cannot create file: directory '" + (directory / "no") + "' does not exist");
  EXPECT_EQ(error_of([&] { StagedFile file(directory.path().string()); }),
            directory.path().string() + ": cannot write: it is a directory");
  // A name with a control character is shown escaped.
  EXPECT_EQ(error_of([&] { StagedFile file(directory / "no\x1b/x"); }),
            directory / "no\\x1b/x: cannot create file: directory '" + (directory / "no\\x1b") +
                "' does not exist");
  // Writing after flush() is refused, and the temporary file is gone.
  StagedFile file(directory / "late.bin");
  file.flush();
  EXPECT_NE(error_of([&] { file.write("late"); }).find("late.bin: cannot write"),
            std::string::npos);
  EXPECT_TRUE(directory.listing().empty());
}

TEST(StagedFile, AFailedWriteRemovesTheTemporaryFile) {
  const TemporaryDirectory directory;
  const std::string path = directory / "out.bin";
  write_file_bytes(path, "old");
  // A file size limit of 1 KiB makes the write fail with EFBIG instead of killing the process.
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto saved_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string message = error_of([&] {
    StagedFile file(path);
    file.write(std::string(4096, 'x'));
    file.commit();
  });
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, saved_handler);
  EXPECT_EQ(message, path + ": cannot write: " + std::strerror(EFBIG));
  EXPECT_EQ(read_file_bytes(path), "old");
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"out.bin"});
}

// --- Writers of one path at once ---------------------------------------------------------------

// `count` float32 values, all `value`.
Tensor filled(int64_t count, int value) {
  Tensor tensor(DType::kFloat32, Shape({count}));
  for (int64_t i = 0; i < count; ++i) tensor.data_as<float>()[i] = static_cast<float>(value);
  return tensor;
}

// One way of writing a file: `write(path, id)` writes writer `id`'s contents, which differ
// from every other writer's in bytes and in length.
struct Writer {
  const char* name;
  std::function<void(const std::string& path, int id)> write;
};
// gtest shows a failing test's parameter by its name, not as a dump of its 40 bytes.
void PrintTo(const Writer& writer, std::ostream* os) { *os << writer.name; }

const Writer kWriters[] = {
    {"StagedFile",
     [](const std::string& path, int id) {
       StagedFile file(path);
       file.write(std::string(1000 + 100 * static_cast<size_t>(id), static_cast<char>('a' + id)));
       file.commit();
     }},
    {"write_npy",
     [](const std::string& path, int id) { write_npy(path, filled(100 + 37 * id, id).view()); }},
    {"save_safetensors",
     [](const std::string& path, int id) {
       const Tensor weights = filled(100 + 37 * id, id);
       save_safetensors(path, {{"weights", weights.view()}}, {{"writer", std::to_string(id)}});
     }},
};

class WritersOfOnePath : public ::testing::TestWithParam<Writer> {
 protected:
  static constexpr int kWrites = 20;

  // Every writer's file, written alone, by contents.
  std::set<std::string> whole_files(int writers) const {
    const TemporaryDirectory alone;
    std::set<std::string> files;
    for (int id = 0; id < writers; ++id) {
      const std::string path = alone / ("file" + std::to_string(id));
      GetParam().write(path, id);
      files.insert(read_file_bytes(path));
    }
    EXPECT_EQ(files.size(), static_cast<size_t>(writers));
    return files;
  }

  // Reads `path` until `done`: every read is one writer's whole file (or nothing yet).
  static void read_until(const std::string& path, const std::set<std::string>& whole,
                         const std::atomic<bool>& done) {
    int reads = 0, partial = 0;
    while (!done.load()) {
      const std::string bytes = read_file_bytes(path);
      ++reads;
      if (!bytes.empty() && whole.count(bytes) == 0) ++partial;
    }
    EXPECT_EQ(partial, 0) << "of " << reads << " reads";
  }
};

TEST_P(WritersOfOnePath, ThreadsLeaveOneWholeFile) {
  constexpr int kThreads = 8;
  const std::set<std::string> whole = whole_files(kThreads);
  const TemporaryDirectory directory;
  const std::string path = directory / "shared";
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::thread reader(read_until, path, std::cref(whole), std::cref(done));
  std::vector<std::thread> writers;
  for (int id = 0; id < kThreads; ++id) {
    writers.emplace_back([&, id] {
      for (int i = 0; i < kWrites; ++i) {
        try {
          GetParam().write(path, id);
        } catch (const Error& e) {
          ADD_FAILURE() << "writer " << id << ": " << e.what();
          ++failures;
        }
      }
    });
  }
  for (std::thread& writer : writers) writer.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(whole.count(read_file_bytes(path)), 1u);
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"shared"});
}

TEST_P(WritersOfOnePath, ProcessesLeaveOneWholeFile) {
  constexpr int kProcesses = 4;
  const std::set<std::string> whole = whole_files(kProcesses);
  const TemporaryDirectory directory;
  const std::string path = directory / "shared";
  std::vector<pid_t> children;
  for (int id = 0; id < kProcesses; ++id) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      break;
    }
    if (pid == 0) {  // the child writes, and leaves without running anything of the test's
      int status = 0;
      for (int i = 0; i < kWrites; ++i) {
        try {
          GetParam().write(path, id);
        } catch (const Error&) {
          status = 1;
        }
      }
      ::_exit(status);
    }
    children.push_back(pid);
  }
  std::atomic<bool> done{false};
  std::thread reader(read_until, path, std::cref(whole), std::cref(done));
  for (const pid_t pid : children) {
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  done = true;
  reader.join();
  EXPECT_EQ(whole.count(read_file_bytes(path)), 1u);
  EXPECT_EQ(directory.listing(), std::vector<std::string>{"shared"});
}

INSTANTIATE_TEST_SUITE_P(EveryWriter, WritersOfOnePath, ::testing::ValuesIn(kWriters),
                         [](const ::testing::TestParamInfo<Writer>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace attend::detail
