// A read-only memory mapping of a whole file. The mapping lives as long as the object.
// Also the one way the io layer writes files: write_file_atomic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::io {

class MappedFile {
 public:
  // Error names the path and the OS reason (missing, not a regular file, unreadable).
  static Result<std::unique_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct ConstBytes {
  const void* data;
  size_t n_bytes;
};

// Writes the concatenation of `chunks` to `path` through `path.tmp.<pid>`, renamed into place,
// so a failure leaves neither a partial `path` nor the temporary. Errors name `path`.
// Two threads of one process must not write the same path at once (same temporary name).
Status write_file_atomic(const std::string& path, const std::vector<ConstBytes>& chunks);

}  // namespace ts::io
