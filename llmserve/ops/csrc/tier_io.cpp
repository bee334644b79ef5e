// Disk KV tier I/O (llmserve/kv_transfer/disk_store.py's block files, format version 3): read a
// request's block files straight into the KV cache's slots and verify them, all blocks in one
// call without the GIL, on up to `threads` threads. Bound and documented in llmserve/ops/tier_io.py.
//
// Why C++: the Python loop (open, one readv of 2 x num_layers pieces, XXH3, futimens, close per
// block, slices built per block) cost ~2.8 ms of Python per 249-block (92 MB, SmolLM2
// 4,000-token) load on top of the ~8 ms copy, on the request path.
//
// File format (little endian, 76-byte header, then the payload): magic[8] "LLMSKV\0\1",
// version u32, layout key[32], block hash u64, parent hash u64, payload bytes u64, XXH3-64 of
// the payload u64. The payload is the block's K and V slot of every layer, in cache order.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kFormatVersion = 3;
constexpr size_t kHeaderSize = 76;
constexpr size_t kPrefixSize = 44;  // magic, version, layout key: equal in every file of a layout
constexpr size_t kMagicVersionSize = 12;
constexpr size_t kHashOffset = 44, kBytesOffset = 60, kChecksumOffset = 68;

// Per-block outcomes (tier_io.py maps them to the same reasons disk_store.py logs).
enum Status : int8_t {
  kOk = 0,
  kMissing = 1,      // no such file (evicted since the scheduler counted it)
  kUnreadable = 2,   // open/read failed otherwise
  kShortHeader = 3,  // shorter than its header
  kBadVersion = 4,   // magic or version differ
  kBadKey = 5,       // another model, dtype or layout
  kBadHash = 6,      // holds another block
  kBadSize = 7,      // payload size differs (truncated, longer)
  kBadChecksum = 8,  // XXH3-64 differs
  kSkipped = 9,      // not read: an earlier block of the chain failed
};

// ---- XXH3-64 (seed 0, default secret), inputs longer than 240 bytes --------------------
// Written from the XXH3 specification (Yann Collet's xxHash, v0.8); the bytes equal the
// python xxhash package's xxh3_64 for any split of the input (tests/kv_transfer/test_tier_io.py).
constexpr uint64_t P32_1 = 0x9E3779B1ULL, P32_2 = 0x85EBCA77ULL, P32_3 = 0xC2B2AE3DULL;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL, P64_3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P64_4 = 0x85EBCA77C2B2AE63ULL, P64_5 = 0x27D4EB2F165667C5ULL, PMX1 = 0x165667919E3779F9ULL;
constexpr size_t kStripe = 64, kSecretSize = 192, kStripesPerBlock = (kSecretSize - kStripe) / 8;  // 16
constexpr size_t kBlockLen = kStripe * kStripesPerBlock;  // 1024 bytes per scramble

alignas(64) const uint8_t kSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64 LE): the file format's order
  return v;
}

// One 64-byte stripe into the 8 accumulators: acc[i] += lo32(dk) * hi32(dk) + data[i ^ 1],
// dk = data[i] ^ key[i].
inline void accumulate_stripe(uint64_t* __restrict acc, const uint8_t* __restrict in, const uint8_t* __restrict key) {
#if defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + h);
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + h);
    const __m256i dk = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key) + h));
    const __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
    a = _mm256_add_epi64(a, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + h, _mm256_add_epi64(a, prod));
  }
#else
  for (int i = 0; i < 8; ++i) {
    const uint64_t d = read64(in + 8 * i), dk = d ^ read64(key + 8 * i);
    acc[i ^ 1] += d;
    acc[i] += (dk & 0xFFFFFFFFULL) * (dk >> 32);
  }
#endif
}

inline void scramble(uint64_t* acc, const uint8_t* key) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= read64(key + 8 * i);
    acc[i] = a * P32_1;
  }
}

inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

// The bytes of `pieces` (in order) as one stream of 64-byte stripes; a stripe that spans two
// pieces is gathered into `tmp` (none does when every piece is a multiple of 64 bytes, as
// the KV slots are).
struct StripeReader {
  const iovec* v;
  size_t n, i = 0, off = 0;
  alignas(64) uint8_t tmp[kStripe];

  // Pointer to the next stripe and how many whole stripes follow contiguously (>= 1).
  const uint8_t* next(size_t* run) {
    while (i < n && off == v[i].iov_len) ++i, off = 0;
    const size_t left = v[i].iov_len - off;
    const uint8_t* p = static_cast<const uint8_t*>(v[i].iov_base) + off;
    if (left >= kStripe) {
      *run = left / kStripe;
      return p;
    }
    size_t k = 0;
    while (k < kStripe) {
      while (off == v[i].iov_len) ++i, off = 0;
      const size_t take = std::min(kStripe - k, v[i].iov_len - off);
      std::memcpy(tmp + k, static_cast<const uint8_t*>(v[i].iov_base) + off, take);
      k += take, off += take;
    }
    *run = 1;
    return tmp;
  }
  void advance(size_t stripes) { off += stripes * kStripe; }  // after a direct next(): stripes <= run
};

// accumulate_stripe over `count` consecutive stripes at `in`, stripe k with key + 8 k; with
// AVX2 the accumulators stay in registers (a 249-block load hashes 92 MB: ~1.8 ms per thread
// with a load/store of them per stripe).
inline void accumulate_stripes(uint64_t* __restrict acc, const uint8_t* __restrict in, const uint8_t* __restrict key,
                               size_t count) {
#if defined(__AVX2__)
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + 1);
  for (size_t k = 0; k < count; ++k, in += kStripe, key += 8) {
    const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
    const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + 1);
    const __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
    const __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key) + 1));
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))),
                          _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32)));
    a1 = _mm256_add_epi64(_mm256_add_epi64(a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))),
                          _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + 1, a1);
#else
  for (size_t k = 0; k < count; ++k) accumulate_stripe(acc, in + k * kStripe, key + 8 * k);
#endif
}

// Accumulate `count` stripes from the reader, stripe s with secret + 8 * (first + s).
inline void accumulate_run(uint64_t* acc, StripeReader& r, size_t first, size_t count) {
  size_t s = 0;
  while (s < count) {
    size_t run;
    const uint8_t* p = r.next(&run);
    if (p == r.tmp) {
      accumulate_stripe(acc, p, kSecret + 8 * (first + s));
      ++s;  // next() already moved past the gathered bytes
      continue;
    }
    const size_t take = std::min(run, count - s);
    accumulate_stripes(acc, p, kSecret + 8 * (first + s), take);
    r.advance(take);
    s += take;
  }
}

// The last 64 bytes of the stream (XXH3's final stripe overlaps the ones before it).
void gather_tail(const iovec* v, size_t n, size_t total, uint8_t* out) {
  size_t pos = 0, want = total - kStripe, k = 0;
  for (size_t i = 0; i < n && k < kStripe; ++i) {
    const size_t len = v[i].iov_len;
    if (pos + len > want) {
      const size_t from = want > pos ? want - pos : 0;
      const size_t take = std::min(len - from, kStripe - k);
      std::memcpy(out + k, static_cast<const uint8_t*>(v[i].iov_base) + from, take);
      k += take;
    }
    pos += len;
  }
}

// XXH3-64 of the concatenated pieces (total > 240 bytes).
uint64_t xxh3_64_pieces(const iovec* v, size_t n, size_t total) {
  alignas(64) uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
  StripeReader r{v, n};
  const size_t nb_blocks = (total - 1) / kBlockLen;
  for (size_t b = 0; b < nb_blocks; ++b) {
    accumulate_run(acc, r, 0, kStripesPerBlock);
    scramble(acc, kSecret + kSecretSize - kStripe);
  }
  const size_t last = ((total - 1) - kBlockLen * nb_blocks) / kStripe;
  accumulate_run(acc, r, 0, last);
  alignas(64) uint8_t tail[kStripe];
  gather_tail(v, n, total, tail);
  accumulate_stripe(acc, tail, kSecret + kSecretSize - kStripe - 7);
  uint64_t h = static_cast<uint64_t>(total) * P64_1;
  for (int i = 0; i < 4; ++i)
    h += mul128_fold64(acc[2 * i] ^ read64(kSecret + 11 + 16 * i), acc[2 * i + 1] ^ read64(kSecret + 11 + 16 * i + 8));
  h ^= h >> 37;
  h *= PMX1;
  return h ^ (h >> 32);
}

// ---- block files --------------------------------------------------------------------------

// Read `total` bytes of `fd` from offset 0 into `iov` (cnt entries), then probe one byte more.
// Returns the bytes read (less than total: the file is shorter; total + 1: longer), -1 on error.
ssize_t read_all(int fd, std::vector<iovec>& iov, size_t total) {
  size_t got = 0, i = 0;
  const size_t cnt = iov.size();
  while (i < cnt) {
    const int batch = static_cast<int>(std::min<size_t>(cnt - i, IOV_MAX));
    const ssize_t r = preadv(fd, iov.data() + i, batch, static_cast<off_t>(got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
    size_t rr = static_cast<size_t>(r);
    while (i < cnt && rr >= iov[i].iov_len) rr -= iov[i].iov_len, ++i;
    if (i < cnt && rr) {  // partial entry: move its start (the caller's iov is scratch)
      iov[i].iov_base = static_cast<uint8_t*>(iov[i].iov_base) + rr;
      iov[i].iov_len -= rr;
    }
  }
  if (got == total) {
    uint8_t extra;
    const ssize_t r = pread(fd, &extra, 1, static_cast<off_t>(got));
    if (r > 0) got += 1;
  }
  return static_cast<ssize_t>(got);
}

struct Job {
  int dirfd;
  uint8_t* cache;
  int64_t region_bytes, num_regions, slot_bytes;
  const uint64_t* hashes;
  const int64_t* block_ids;
  const uint8_t* prefix;  // kPrefixSize bytes
  bool touch;
  int8_t* status;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> first_bad;
};

int8_t load_one(Job& job, int64_t b, std::vector<iovec>& iov, std::vector<iovec>& scratch) {
  char name[32];
  std::snprintf(name, sizeof name, "%016llx.kv", static_cast<unsigned long long>(job.hashes[b]));
  const int fd = openat(job.dirfd, name, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? kMissing : kUnreadable;
  alignas(8) uint8_t header[kHeaderSize];
  const size_t nbytes = static_cast<size_t>(job.num_regions * job.slot_bytes);
  iov.clear();
  iov.push_back({header, kHeaderSize});
  for (int64_t r = 0; r < job.num_regions; ++r)
    iov.push_back({job.cache + r * job.region_bytes + job.block_ids[b] * job.slot_bytes, static_cast<size_t>(job.slot_bytes)});
  scratch = iov;
  const ssize_t got = read_all(fd, scratch, kHeaderSize + nbytes);
  int8_t st = kOk;
  if (got < 0) st = kUnreadable;
  else if (static_cast<size_t>(got) < kHeaderSize) st = kShortHeader;
  else if (std::memcmp(header, job.prefix, kMagicVersionSize) != 0) st = kBadVersion;
  else if (std::memcmp(header + kMagicVersionSize, job.prefix + kMagicVersionSize, kPrefixSize - kMagicVersionSize) != 0) st = kBadKey;
  else if (read64(header + kHashOffset) != job.hashes[b]) st = kBadHash;
  else if (read64(header + kBytesOffset) != nbytes || static_cast<size_t>(got) != kHeaderSize + nbytes) st = kBadSize;
  // hashed right after its read, while the block (~360 KiB for SmolLM2) is in this core's L2
  else if (xxh3_64_pieces(iov.data() + 1, iov.size() - 1, nbytes) != read64(header + kChecksumOffset)) st = kBadChecksum;
  if (st == kOk && job.touch) futimens(fd, nullptr);  // LRU order (BlockWriter); a failure is harmless
  close(fd);
  return st;
}

// Blocks are taken 4 at a time from a shared counter; none past the first failed one is read.
void worker(Job* job) {
  std::vector<iovec> iov, scratch;
  iov.reserve(job->num_regions + 1);
  for (;;) {
    const int64_t lo = job->next.fetch_add(4);
    if (lo >= job->n) return;
    for (int64_t b = lo; b < std::min(lo + 4, job->n); ++b) {
      if (b > job->first_bad.load(std::memory_order_relaxed)) {
        job->status[b] = kSkipped;
        continue;
      }
      const int8_t st = load_one(*job, b, iov, scratch);
      job->status[b] = st;
      if (st != kOk) {
        int64_t cur = job->first_bad.load();
        while (b < cur && !job->first_bad.compare_exchange_weak(cur, b)) {
        }
      }
    }
  }
}

}  // namespace

// See llmserve/ops/tier_io.py (read_blocks). Returns how many blocks, from the first, are valid.
int64_t tier_read_blocks(at::Tensor cache, int64_t num_regions, int64_t slot_bytes, const std::string& folder,
                         const std::vector<uint64_t>& hashes, at::Tensor block_ids, const std::string& prefix,
                         bool touch, int64_t threads, at::Tensor status) {
  TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous() && cache.scalar_type() == at::kByte && cache.dim() == 1,
              "tier_read_blocks: cache must be a contiguous 1-d uint8 CPU tensor");
  TORCH_CHECK(num_regions > 0 && slot_bytes > 0 && cache.numel() % num_regions == 0,
              "tier_read_blocks: num_regions must divide the cache's bytes");
  TORCH_CHECK(num_regions * slot_bytes > 240, "tier_read_blocks: payloads of 240 bytes or less are not supported");
  TORCH_CHECK(prefix.size() == kPrefixSize, "tier_read_blocks: prefix must be ", kPrefixSize, " bytes");
  const int64_t n = static_cast<int64_t>(hashes.size());
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.numel() == n,
              "tier_read_blocks: block_ids must be contiguous int64 [len(hashes)]");
  TORCH_CHECK(status.scalar_type() == at::kChar && status.is_contiguous() && status.numel() == n,
              "tier_read_blocks: status must be contiguous int8 [len(hashes)]");
  const int64_t region = cache.numel() / num_regions;
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ids[i] >= 0 && (ids[i] + 1) * slot_bytes <= region, "tier_read_blocks: block id ", ids[i], " out of range");
  if (n == 0) return 0;
  int8_t* st = status.data_ptr<int8_t>();
  const int dirfd = open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) {
    std::fill(st, st + n, static_cast<int8_t>(kMissing));
    return 0;
  }
  Job job;
  job.dirfd = dirfd;
  job.cache = cache.data_ptr<uint8_t>();
  job.region_bytes = region;
  job.num_regions = num_regions;
  job.slot_bytes = slot_bytes;
  job.hashes = hashes.data();
  job.block_ids = ids;
  job.prefix = reinterpret_cast<const uint8_t*>(prefix.data());
  job.touch = touch;
  job.status = st;
  job.n = n;
  job.first_bad.store(n);
  {
    pybind11::gil_scoped_release nogil;
    const int64_t extra = std::max<int64_t>(0, std::min<int64_t>(threads, (n + 7) / 8) - 1);
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < extra; ++t) pool.emplace_back(worker, &job);
    worker(&job);
    for (auto& t : pool) t.join();
  }
  close(dirfd);
  return job.first_bad.load();
}

// How many of `hashes`, from the first, have a file of `size` bytes in `folder` (one fstatat
// each); -(i + 1) when file i exists with another size (the caller removes it).
int64_t tier_count_chain(const std::string& folder, const std::vector<uint64_t>& hashes, int64_t size) {
  pybind11::gil_scoped_release nogil;
  const int dirfd = open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) return 0;
  int64_t i = 0;
  for (; i < static_cast<int64_t>(hashes.size()); ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "%016llx.kv", static_cast<unsigned long long>(hashes[i]));
    struct stat sb;
    if (fstatat(dirfd, name, &sb, 0) != 0) break;
    if (sb.st_size != size) {
      close(dirfd);
      return -(i + 1);
    }
  }
  close(dirfd);
  return i;
}

// Bump the mtime of each existing file of `hashes` in `folder` (one utimensat each, no GIL):
// the LRU order of disk_store.BlockWriter, done on its thread after a load instead of in it.
void tier_touch(const std::string& folder, const std::vector<uint64_t>& hashes) {
  pybind11::gil_scoped_release nogil;
  const int dirfd = open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) return;
  for (const uint64_t h : hashes) {
    char name[32];
    std::snprintf(name, sizeof name, "%016llx.kv", static_cast<unsigned long long>(h));
    utimensat(dirfd, name, nullptr, 0);  // a file evicted meanwhile: nothing to bump
  }
  close(dirfd);
}

// XXH3-64 of the concatenated byte tensors (each contiguous, > 240 bytes in all): the
// checksum the loads verify, exposed for tests.
uint64_t tier_xxh3_64(const std::vector<at::Tensor>& pieces) {
  std::vector<iovec> v;
  size_t total = 0;
  for (const auto& p : pieces) {
    TORCH_CHECK(p.is_contiguous() && p.device().is_cpu(), "tier_xxh3_64: pieces must be contiguous CPU tensors");
    v.push_back({p.data_ptr(), static_cast<size_t>(p.numel() * p.element_size())});
    total += v.back().iov_len;
  }
  TORCH_CHECK(total > 240, "tier_xxh3_64: inputs of 240 bytes or less are not supported");
  return xxh3_64_pieces(v.data(), v.size(), total);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("FORMAT_VERSION") = kFormatVersion;
  m.attr("HEADER_SIZE") = kHeaderSize;
  m.def("read_blocks", &tier_read_blocks, "tier_read_blocks");
  m.def("count_chain", &tier_count_chain, "tier_count_chain");
  m.def("touch", &tier_touch, "tier_touch");
  m.def("xxh3_64", &tier_xxh3_64, "tier_xxh3_64");
}
