// Where the tests find their data, for the CPU and CUDA tests alike: TS_TEST_DATA_DIR in the
// environment overrides the build-time path (tests/gpu/run.sh runs binaries built elsewhere;
// the fixture list is built when the binary starts, so it must find them then), and the
// fixture models (the directories of tests/models with a ref.json and logits.npy), and a
// temporary directory.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace ts_test {

inline std::filesystem::path data_dir() {
  const char* env = std::getenv("TS_TEST_DATA_DIR");
  return std::filesystem::path(env && *env ? env : TS_TEST_DATA_DIR);
}

inline std::vector<std::string> fixture_names() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(data_dir() / "models"))
    if (std::filesystem::exists(e.path() / "ref.json") &&
        std::filesystem::exists(e.path() / "logits.npy"))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A fresh directory under /tmp (named /tmp/<tag>_XXXXXX), removed with its contents when the
// object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "ts") {
    std::string tmpl = "/tmp/" + tag + "_XXXXXX";
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace ts_test
