// The pure parts of `pull` and `--model ORG/NAME`: repo ids, ETags, the huggingface_hub cache
// paths, include globs, and resolving a cache written by hand in the Python library's layout.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include "hub/hub_cache.h"

namespace fs = std::filesystem;
using namespace ts::hub;

TEST(HubRepoRef, ParsesOrgNameAndRevision) {
  auto r = parse_repo_ref("Qwen/Qwen3-30B-A3B");
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->repo_id, "Qwen/Qwen3-30B-A3B");
  EXPECT_EQ(r->revision, "main");
  auto v = parse_repo_ref("org/name.v1_2@refs/pr/3");
  ASSERT_TRUE(v.ok()) << v.error().message;
  EXPECT_EQ(v->repo_id, "org/name.v1_2");
  EXPECT_EQ(v->revision, "refs/pr/3");
}

TEST(HubRepoRef, RefusesWhatTheHubRefuses) {
  for (const char* bad :
       {"noslash", "a/b/c", "/name", "org/", "org/-name", "org/name.", "org/na--me", "org/na..me",
        "org/na me", "org/name@", "org/name@a..b", "org/name@x y", "../etc", "org/name@/x"})
    EXPECT_FALSE(parse_repo_ref(bad).ok()) << bad;
  EXPECT_FALSE(parse_repo_ref("o/" + std::string(95, 'n')).ok());  // 97 characters
  EXPECT_TRUE(parse_repo_ref("o/" + std::string(94, 'n')).ok());   // 96
}

TEST(HubEtag, Normalizes) {
  EXPECT_EQ(normalize_etag("\"abc123\""), "abc123");
  EXPECT_EQ(normalize_etag("W/\"abc123\""), "abc123");
  EXPECT_EQ(normalize_etag("  \"abc\"\r\n"), "abc");
  EXPECT_EQ(normalize_etag("plain"), "plain");
  EXPECT_TRUE(is_sha256_hex(std::string(64, 'a')));
  EXPECT_FALSE(is_sha256_hex(std::string(63, 'a')));
  EXPECT_FALSE(is_sha256_hex(std::string(64, 'A')));
  EXPECT_TRUE(is_commit_hash("0123456789abcdef0123456789abcdef01234567"));
  EXPECT_FALSE(is_commit_hash("main"));
}

TEST(HubCachePaths, MatchThePythonLayout) {
  EXPECT_EQ(repo_folder_name("julien-c/EsperBERTo-small"), "models--julien-c--EsperBERTo-small");
  const RepoCache c("/cache", "org/name");
  EXPECT_EQ(c.blob("e1").string(), "/cache/models--org--name/blobs/e1");
  EXPECT_EQ(c.incomplete("e1").string(), "/cache/models--org--name/blobs/e1.incomplete");
  EXPECT_EQ(c.lock("e1").string(), "/cache/.locks/models--org--name/e1.lock");
  EXPECT_EQ(c.pointer("abc", "sub/f.json").string(),
            "/cache/models--org--name/snapshots/abc/sub/f.json");
  EXPECT_EQ(c.ref("main").string(), "/cache/models--org--name/refs/main");
  EXPECT_EQ(pointer_target("config.json", "e1"), "../../blobs/e1");
  EXPECT_EQ(pointer_target("a/b/c.bin", "e1"), "../../../../blobs/e1");
}

TEST(HubCachePaths, UnsafeFileNamesAreRefused) {
  EXPECT_TRUE(is_safe_rfilename("model-00001-of-00002.safetensors"));
  EXPECT_TRUE(is_safe_rfilename("sub/dir/f.gguf"));
  for (const char* bad : {"", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/", "a\\b"})
    EXPECT_FALSE(is_safe_rfilename(bad)) << bad;
}

TEST(HubIncludes, DefaultsTakeTheModelFilesOnly) {
  const auto& d = default_includes();
  for (const char* yes :
       {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
        "model-00001-of-00003.safetensors", "model.safetensors.index.json",
        "generation_config.json", "chat_template.jinja"})
    EXPECT_TRUE(matches_any(d, yes)) << yes;
  for (const char* no : {"README.md", "pytorch_model.bin", "consolidated.safetensors",
                         "onnx/model.safetensors", "model-q4_k_m.gguf", ".gitattributes"})
    EXPECT_FALSE(matches_any(d, no)) << no;
  // As huggingface_hub's allow_patterns: '*' crosses '/', a trailing '/' means a folder.
  EXPECT_TRUE(matches_any({"*Q4_K_M*"}, "Q4_K_M/m-00001-of-00002.gguf"));
  EXPECT_TRUE(matches_any({"sub/"}, "sub/x/y.bin"));
  EXPECT_FALSE(matches_any({"*Q4_K_M*"}, "m-Q8_0.gguf"));
}

TEST(HubUrl, QuotesAsPython) {
  EXPECT_EQ(url_quote("refs/pr/1", ""), "refs%2Fpr%2F1");
  EXPECT_EQ(url_quote("a b/c+d.json", "/"), "a%20b/c%2Bd.json");
}

class HubCacheDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ts_hub_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  static void write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
  fs::path dir_;
};

// A cache as the Python library writes it, by hand: blobs, a relative snapshot link, refs/main.
TEST_F(HubCacheDir, ResolvesAHandWrittenPythonCache) {
  const std::string commit = "1111111111111111111111111111111111111111";
  const fs::path repo = dir_ / "models--org--name";
  write(repo / "blobs" / "abc", "{}");
  fs::create_directories(repo / "snapshots" / commit);
  fs::create_symlink("../../blobs/abc", repo / "snapshots" / commit / "config.json");
  write(repo / "refs" / "main", commit);  // no newline, as Path.write_text leaves it
  auto snap = resolve_cached(dir_, {"org/name", "main"});
  ASSERT_TRUE(snap.ok()) << snap.error().message;
  EXPECT_EQ(*snap, repo / "snapshots" / commit);
  EXPECT_TRUE(fs::is_regular_file(*snap / "config.json"));
  // A commit hash needs no ref.
  auto by_commit = resolve_cached(dir_, {"org/name", commit});
  ASSERT_TRUE(by_commit.ok()) << by_commit.error().message;
  // Missing: the message says to pull.
  auto missing = resolve_cached(dir_, {"org/other", "main"});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("turbospark pull org/other"), std::string::npos)
      << missing.error().message;
  auto no_tag = resolve_cached(dir_, {"org/name", "v2"});
  ASSERT_FALSE(no_tag.ok());
  EXPECT_NE(no_tag.error().message.find("turbospark pull org/name@v2"), std::string::npos);
  // A ref naming a snapshot that is not there.
  write(repo / "refs" / "v3", "2222222222222222222222222222222222222222");
  EXPECT_FALSE(resolve_cached(dir_, {"org/name", "v3"}).ok());
  write(repo / "refs" / "bad", "not a hash");
  EXPECT_FALSE(resolve_cached(dir_, {"org/name", "bad"}).ok());
}

TEST_F(HubCacheDir, EnvironmentPicksTheCacheAsPythonDoes) {
  const char* keep[] = {"HF_HUB_CACHE", "HF_HOME", "HF_ENDPOINT", "HF_TOKEN", "HF_TOKEN_PATH"};
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const char* k : keep) {
    const char* v = std::getenv(k);
    saved.emplace_back(k, v ? std::optional<std::string>(v) : std::nullopt);
    ::unsetenv(k);
  }
  ::setenv("HF_HOME", dir_.c_str(), 1);
  write(dir_ / "token", "hf_abc\n");
  HubEnv e = read_hub_env();
  EXPECT_EQ(e.cache_dir, dir_ / "hub");
  EXPECT_EQ(e.token, "hf_abc");
  EXPECT_EQ(e.endpoint, "https://huggingface.co");
  ::setenv("HF_HUB_CACHE", (dir_ / "c").c_str(), 1);
  ::setenv("HF_ENDPOINT", "http://127.0.0.1:1/", 1);
  ::setenv("HF_TOKEN", "hf_env", 1);
  e = read_hub_env();
  EXPECT_EQ(e.cache_dir, dir_ / "c");
  EXPECT_EQ(e.endpoint, "http://127.0.0.1:1");
  EXPECT_EQ(e.token, "hf_env");
  // --model ORG/NAME goes to that cache; an existing path stays a path.
  auto r = resolve_model_arg("org/none");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("turbospark pull org/none"), std::string::npos);
  EXPECT_EQ(resolve_model_arg(dir_.string()).value(), dir_.string());
  EXPECT_EQ(resolve_model_arg("not a repo").value(), "not a repo");
  for (auto& [k, v] : saved) {
    if (v)
      ::setenv(k.c_str(), v->c_str(), 1);
    else
      ::unsetenv(k.c_str());
  }
}
