// Read-only whole-file mappings (open/fstat/mmap) and atomic whole-file writes (temp + rename).
#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace ts::io {

namespace {

// strerror is not thread-safe; the system category message is.
std::string os_reason(int err) { return std::system_category().message(err); }

// Closes the descriptor on every return path.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now and reports the result: for written files close() can be the first to fail.
  int close_now() {
    int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

}  // namespace

Result<std::unique_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  // O_NONBLOCK so that opening a FIFO by mistake fails the regular-file check below instead of
  // blocking for a writer; it has no effect on regular files.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) return make_error("cannot open " + path + ": " + os_reason(errno));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return make_error("cannot stat " + path + ": " + os_reason(errno));
  }
  if (!S_ISREG(st.st_mode)) return make_error(path + " is not a regular file");

  auto file = std::unique_ptr<MappedFile>(new MappedFile());
  file->path_ = path;
  file->size_ = size_t(st.st_size);
  if (file->size_ == 0) return file;  // mmap of length 0 is EINVAL; an empty file maps to nothing
  void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) {
    int err = errno;
    file->size_ = 0;
    return make_error("cannot map " + path + ": " + os_reason(err));
  }
  // A hint: where the kernel reads a model's pages into the page cache on first touch, it
  // reads them in 2 MiB folios and maps them with one TLB entry each (decode streams the
  // weights; on 4 KiB pages their translations miss the TLB: docs/PERF.md). Ignored where
  // transparent huge pages are off.
  ::madvise(p, file->size_, MADV_HUGEPAGE);
  file->data_ = static_cast<const uint8_t*>(p);
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

Status write_file_atomic(const std::string& path, const std::vector<ConstBytes>& chunks) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    return make_error("cannot write " + path + ": cannot create " + tmp + ": " + os_reason(errno));
  }
  auto fail = [&](const std::string& what, int err) -> Status {
    ::unlink(tmp.c_str());
    return make_error("cannot write " + path + ": " + what + " " + tmp + ": " + os_reason(err));
  };
  for (const ConstBytes& chunk : chunks) {
    const char* p = static_cast<const char*>(chunk.data);
    size_t left = chunk.n_bytes;
    while (left > 0) {
      ssize_t n = ::write(fd.get(), p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail("write to", errno);
      if (n == 0) return fail("write to", EIO);
      p += n;
      left -= size_t(n);
    }
  }
  if (fd.close_now() != 0) return fail("close of", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename of", errno);
  return Status::ok_status();
}

}  // namespace ts::io
