// fusedmoe: safetensors files (format: huggingface/safetensors, docs "Format").
//
// Files are memory-mapped; get() returns a Tensor viewing the mapping (zero
// copy) that keeps the mapping alive. open() validates the whole header before
// anything is returned, as HF's safetensors (0.8) does: file at least 8 bytes,
// header length within the file, header valid JSON object (not after a UTF-8
// byte-order mark, which HF's serde_json refuses too), dtype strings HF's
// safetensors knows (safetensors_dtype_bits: those fusedmoe cannot read too),
// data_offsets inside the data section, numel * dtype bits a whole number of
// bytes (F4 and F6_* pack sub-byte elements) and end - begin that number, no
// two tensors overlapping, and the tensors covering the data section one after
// another from offset 0 (no unused bytes between them or after the last one).
// Any violation throws Error(kIo) naming the file (and the tensor).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fusedmoe/core/tensor.h"

namespace fusedmoe {

// Throws Error(kIo) naming `path` when it exists and is not a regular file (a
// FIFO would block a reader forever; a device or directory is no checkpoint).
// A missing path is left to the opener's own error.
void require_regular_file(const std::string& path);

// Whether `path` is a regular file that begins as a safetensors file does: an
// 8-byte little-endian header length that fits in the file, then '{' (a JSON
// text such as config.json begins otherwise). Told by content, whatever the
// name; false when the file cannot be read. open() still validates the rest.
bool looks_like_safetensors(const std::string& path);

// Safetensors dtype strings ("F32", "BF16", "F8_E4M3", ...) <-> DType: the
// twelve of kSupportedSafetensorsDTypes.
DType parse_safetensors_dtype(const std::string& s);  // throws Error(kIo) if unknown
const char* safetensors_dtype_name(DType dtype);
// The safetensors dtype strings fusedmoe reads (parse_safetensors_dtype), in a
// line as messages list them.
inline constexpr const char* kSupportedSafetensorsDTypes =
    "F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL";
// Bits of one element of a dtype HF's safetensors (0.8) knows, whether or not
// fusedmoe reads it: 4 for F4, 6 for F6_E2M3 and F6_E3M2, 8 for BOOL U8 I8
// F8_E4M3 F8_E5M2 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ, 16 for I16 U16 F16 BF16, 32
// for I32 U32 F32, 64 for I64 U64 F64 C64; 0 for any other string (a file
// holding one is refused).
int safetensors_dtype_bits(std::string_view s);

class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();

  // What the header says of one tensor, whatever its dtype.
  struct Info {
    std::string dtype_name;      // the header's dtype string: "F32", "U32", "F8_E8M0", ...
    std::optional<DType> dtype;  // empty for a dtype fusedmoe does not read (get() refuses it)
    std::vector<int64_t> shape;
    size_t nbytes = 0;  // bytes in the file
  };

  const std::string& path() const { return path_; }
  // Every tensor, those of dtypes fusedmoe does not read (U32, F8_E8M0, F4, ...) too.
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  // Throws Error(kIo) "FILE: no tensor named NAME" when absent.
  Info info(const std::string& name) const;
  // Throws Error(kIo) "FILE: no tensor named NAME" when absent, Error(kUnsupported)
  // "FILE: tensor 'NAME': dtype U32 is not supported by fusedmoe (supported: ...)"
  // for a dtype that parse_safetensors_dtype does not take, and Error(kUnsupported)
  // for more than kMaxDims dimensions. The view is read-only (a PROT_READ mapping):
  // never write through it; copy first (Tensor::copy_of).
  Tensor get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Entry {
    std::string dtype_name;      // as the header spells it
    std::optional<DType> dtype;  // empty: a dtype HF's safetensors knows, fusedmoe does not
    std::vector<int64_t> shape;
    size_t begin, end;  // offsets in the data section
  };
  SafetensorsFile() = default;
  std::string path_;
  std::shared_ptr<void> mapping_;  // whole file
  size_t file_size_ = 0;
  size_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: `model.safetensors`, or a sharded one through
// `model.safetensors.index.json` (weight_map: tensor -> shard file), or a
// single .safetensors file path; a model's config.json stands for its directory. Shards are opened
// lazily, once each, so get() is not thread-safe: fetch tensors from one thread (they may then be
// read anywhere). Throws Error(kIo) when the path is empty, has none of these or the index is
// malformed, or names a shard outside the index's folder (an absolute path, or one that leads up
// out of it with ".."); a shard that cannot be opened is an Error naming the index, the tensor and
// the shard. A ".." in a shard's path is resolved as the OS (and so HF's reader) resolves it: the
// folder it steps out of must exist and be a directory (`sub/../x.safetensors` with no folder `sub`
// cannot be opened) whose parent is the folder its name says (not elsewhere through a symbolic
// link); else get() and info() of the shard's tensors throw Error(kIo) naming the index, the tensor
// and the shard.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);
  bool contains(const std::string& name) const;
  // Throws Error(kIo) naming the tensor and the checkpoint when absent, and
  // what SafetensorsFile::get throws (a dtype fusedmoe does not read:
  // Error(kUnsupported)).
  Tensor get(const std::string& name) const;
  // The header's word on the tensor (SafetensorsFile::info), whatever its
  // dtype; opens its shard as get() does and throws as get() does for an
  // absent tensor or a shard that cannot be opened.
  SafetensorsFile::Info info(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::string& path() const { return path_; }
  // Every file the checkpoint reads: the index (when sharded), then each
  // distinct shard (or the one .safetensors file).
  std::vector<std::string> files() const;
  // The index file of a sharded checkpoint; empty for one .safetensors file.
  const std::string& index_path() const { return index_; }

 private:
  std::string path_;
  std::string index_;  // model.safetensors.index.json of a sharded checkpoint, else empty
  std::map<std::string, std::string> weight_map_;  // name -> shard path
  mutable std::map<std::string, std::shared_ptr<SafetensorsFile>> shards_;
  // name -> its weight_map entry as the index gives it, for one holding "..".
  std::map<std::string, std::string> dotdot_;
  // The shard holding `name` (opened on first use), checked to hold it.
  const SafetensorsFile& shard_of(const std::string& name) const;
};

// A file written in full or not at all: the bytes go to a temporary file in the
// target's folder, which commit() renames over `path` (fsync'd first; a replaced
// file keeps its permission bits, a new one gets 0666 less the umask); destroyed
// without commit() (an error on the way), the temporary is removed. The target
// may be missing or a regular file; a symbolic link to an existing file is
// written through (its target is replaced); a link to a missing file, a device,
// FIFO or directory is refused, and so is another user's file in a sticky
// folder (such as /tmp). Every I/O failure throws Error(kIo) naming `path` and
// the OS reason; an empty path, a write after commit() and a second commit()
// are Error(kInvalidArgument).
//
// The temporary is `.<name>.fusedmoe-tmp.<pid>.XXXXXX` beside the target
// (<name> the target's file name, <pid> this process). A process killed by a
// signal no handler sees (SIGKILL, the OOM killer) leaves it behind; the next
// AtomicFile for the same target removes every such temporary whose process no
// longer exists (kill(pid, 0) fails with ESRCH) and lists them in
// removed_stale().
class AtomicFile {
 public:
  // Creates the temporary; Error(kIo) when `path` exists and is not a regular
  // file, or is read-only (no write bit, or not writable by this user).
  explicit AtomicFile(const std::string& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }
  void commit();
  const std::string& path() const { return path_; }
  // The stale temporaries of the same target that the constructor removed.
  const std::vector<std::string>& removed_stale() const { return removed_stale_; }
  // The temporaries `.<name>.fusedmoe-tmp.<pid>.XXXXXX` (six letters or digits) of `target` (the
  // path whose folder and file name they share) left by processes that no longer exist (not this
  // one): unlinks those that are regular files, returns their paths.
  static std::vector<std::string> remove_stale_temporaries(const std::string& target);
  // Unlinks the temporaries of every AtomicFile not yet committed or destroyed
  // (up to 16 at once): async-signal-safe, for a SIGINT / SIGTERM handler (the
  // CLI installs one) so that an interrupted write leaves no file behind.
  static void remove_pending_temporaries() noexcept;

 private:
  [[noreturn]] void fail(const char* what);  // removes the temporary, throws
  std::string path_, target_, tmp_;
  std::vector<std::string> removed_stale_;
  int fd_ = -1;
  bool replaces_ = false;  // the target exists (keep its permission bits)
  int slot_ = -1;          // in the registry of remove_pending_temporaries()
  unsigned mode_ = 0;
};

// Writes tensors (any host views; written contiguous) and string metadata to
// `path` atomically: a temporary file in the same folder is renamed over
// `path` only after everything was written, so a failure leaves no partial file.
// Layout as the reference writer: tensors ordered by dtype size (largest first)
// then name, header padded with spaces to a multiple of 8 bytes.
// Throws Error(kIo) on failure, Error(kInvalidArgument) on duplicate names.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, TensorView>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// The same into `file`, created earlier (so that a path that cannot be
// written fails before the work that produces the tensors), not committed:
// the caller commits it once everything else the file depends on succeeded
// (`fusedmoe run`: its report reached the standard output), or destroys it
// (no file). Throws as save_safetensors.
void write_safetensors(AtomicFile& file,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace fusedmoe
