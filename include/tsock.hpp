/*
 * tsock.hpp - header-only C++17 wrapper over tsock.h.
 *
 *   tsock::Reader r("train");                 // attach (throws tsock::Error)
 *   while (auto b = r.acquire()) {            // std::nullopt once closed
 *     const float *x = b->data<float>(0);
 *     ...
 *     r.release(*b);
 *   }
 *
 * Every failure throws tsock::Error, whose status() is the tsock_status.
 * Reader works with libtsock_reader.so or libtsock.so; Producer needs
 * libtsock.so. Classes are movable, not copyable, and follow the thread
 * rules of tsock.h.
 */
#ifndef TSOCK_HPP
#define TSOCK_HPP

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "tsock.h"

namespace tsock {

/* A failed tsock call: what() has the detailed message. */
class Error : public std::runtime_error {
 public:
  Error(int status, const std::string &what) : std::runtime_error(what), status_(status) {}
  int status() const noexcept { return status_; }

 private:
  int status_;
};

namespace detail {
inline void check(int rc, const char *call) {
  if (rc >= 0) return;
  const char *msg = tsock_last_error();
  throw Error(rc, std::string(call) + ": " + (msg != nullptr && *msg != '\0' ? msg : tsock_status_str(rc)));
}
}  // namespace detail

/* A C-contiguous tensor at `offset` bytes of the payload (tsock_tensor_init). */
inline tsock_tensor_t tensor(int dtype, std::initializer_list<int64_t> shape, uint64_t offset = 0) {
  tsock_tensor_t t;
  detail::check(tsock_tensor_init(&t, dtype, static_cast<int>(shape.size()), shape.begin(), offset),
                "tsock_tensor_init");
  return t;
}

/* An acquired batch: a view, valid until it is released or the reader goes. */
class BatchView {
 public:
  explicit BatchView(const tsock_batch_t *b) noexcept : b_(b) {}

  uint64_t seq() const noexcept { return b_->seq; }
  uint64_t epoch() const noexcept { return b_->epoch; }
  uint64_t index() const noexcept { return b_->index; }
  uint32_t flags() const noexcept { return b_->flags; }
  bool epoch_end() const noexcept { return (b_->flags & TSOCK_BATCH_EPOCH_END) != 0; }

  std::size_t size() const noexcept { return b_->n_tensors; }
  /* Tensor i; throws Error (TSOCK_EINVAL) when the batch has no tensor i
   * (a batch of another shape than the reader expects, an epoch-end
   * marker), never reads past the batch's tensors. */
  const tsock_tensor_t &operator[](std::size_t i) const { return b_->tensors[checked(i)]; }
  const tsock_tensor_t *begin() const noexcept { return b_->tensors; }
  const tsock_tensor_t *end() const noexcept { return b_->tensors + b_->n_tensors; }
  /* Tensor i's first element as T (read-only shared memory); the index is
   * checked as by operator[]. */
  template <class T>
  const T *data(std::size_t i) const {
    return static_cast<const T *>(b_->tensors[checked(i)].data);
  }

  const void *meta() const noexcept { return b_->meta; }
  std::size_t meta_size() const noexcept { return b_->meta_len; }
  const tsock_batch_t *get() const noexcept { return b_; }

  /* The device path (after Reader::open_device() returned true): orders the
   * batch's device copy on `stream` (a CUstream / cudaStream_t, 0 for the
   * legacy default stream; see tsock_batch_cuda_use), then tensor i's
   * device address. */
  void cuda_use(uintptr_t stream, uint32_t flags = 0) const {
    detail::check(tsock_batch_cuda_use(b_, stream, flags), "tsock_batch_cuda_use");
  }
  template <class T>
  T *cuda_data(std::size_t i) const {
    uint64_t p = 0;
    detail::check(tsock_batch_cuda_ptr(b_, static_cast<uint32_t>(i), &p), "tsock_batch_cuda_ptr");
    return reinterpret_cast<T *>(static_cast<uintptr_t>(p));
  }

 private:
  std::size_t checked(std::size_t i) const {
    if (i >= b_->n_tensors)
      throw Error(TSOCK_EINVAL, "tsock::BatchView: tensor " + std::to_string(i) + " of a batch of " +
                                    std::to_string(b_->n_tensors) + " tensor(s)");
    return i;
  }

  const tsock_batch_t *b_;
};

/* A batch kept past its release (Reader::keep, tsock_batch_keep): its kept
 * tensors stay valid, at their addresses, while this object lives (and
 * while DLPack descriptors of them do), after the release and after the
 * reader is gone. Empty when nothing was to be kept. Move-only. */
class KeptBatch {
 public:
  KeptBatch() noexcept = default;
  explicit KeptBatch(const tsock_batch_t *b) noexcept : b_(b) {}
  KeptBatch(KeptBatch &&o) noexcept : b_(std::exchange(o.b_, nullptr)) {}
  KeptBatch &operator=(KeptBatch &&o) noexcept {
    if (this != &o) {
      reset();
      b_ = std::exchange(o.b_, nullptr);
    }
    return *this;
  }
  KeptBatch(const KeptBatch &) = delete;
  KeptBatch &operator=(const KeptBatch &) = delete;
  ~KeptBatch() { reset(); }

  BatchView view() const noexcept { return BatchView(b_); }
  explicit operator bool() const noexcept { return b_ != nullptr; }

 private:
  void reset() noexcept {
    if (b_ != nullptr) tsock_batch_free(std::exchange(b_, nullptr));
  }
  const tsock_batch_t *b_ = nullptr;
};

class Reader {
 public:
  /* Defaults of tsock_reader_options_init(), to change before attaching. */
  static tsock_reader_options_t options() noexcept {
    tsock_reader_options_t o;
    tsock_reader_options_init(&o);
    return o;
  }

  Reader() noexcept = default;
  explicit Reader(const std::string &name) : Reader(name, options()) {}
  Reader(const std::string &name, const tsock_reader_options_t &opts) {
    detail::check(tsock_reader_attach(name.c_str(), &opts, &r_), "tsock_reader_attach");
  }
  Reader(Reader &&o) noexcept : r_(std::exchange(o.r_, nullptr)), closed_(o.closed_) {}
  Reader &operator=(Reader &&o) noexcept {
    if (this != &o) {
      reset();
      r_ = std::exchange(o.r_, nullptr);
      closed_ = o.closed_;
    }
    return *this;
  }
  Reader(const Reader &) = delete;
  Reader &operator=(const Reader &) = delete;
  ~Reader() { reset(); }

  /* The next batch; std::nullopt when none came within timeout_ns
   * (negative: wait without limit) or when the producer closed the channel
   * and everything was read (then closed() is true). A dead producer
   * throws Error with TSOCK_EPRODUCER_GONE. */
  std::optional<BatchView> acquire(int64_t timeout_ns = -1) {
    const tsock_batch_t *b = nullptr;
    int rc = tsock_reader_acquire(r_, &b, timeout_ns);
    if (rc == TSOCK_EAGAIN) return std::nullopt;
    if (rc == TSOCK_ECLOSED) {
      closed_ = true;
      return std::nullopt;
    }
    detail::check(rc, "tsock_reader_acquire");
    return BatchView(b);
  }

  /* Releases `b` and every batch acquired before it. */
  void release(const BatchView &b) {
    detail::check(tsock_reader_release(r_, b.get()), "tsock_reader_release");
  }

  bool closed() const noexcept { return closed_; }

  /* Keeps the tensors of a held batch named in tensor_mask (bit i: tensor
   * i), and those with live DLPack descriptors, valid past its release, at
   * their addresses (tsock_batch_keep: a copy of their pages). Release the
   * batch as usual afterwards. */
  KeptBatch keep(const BatchView &b, uint32_t tensor_mask) {
    const tsock_batch_t *kept = nullptr;
    detail::check(tsock_batch_keep(r_, b.get(), tensor_mask, &kept), "tsock_batch_keep");
    return KeptBatch(kept);
  }

  /* Opens the producer's device pool: true (and the device's ordinal in
   * *cuda_ordinal) when this process can read batches on the GPU
   * zero-copy; false when it must read host memory (the producer has no
   * pool, or its GPU is not ours: another GPU, a MIG instance), with the
   * reason in tsock_last_error(). Throws without a CUDA driver. */
  bool open_device(int32_t *cuda_ordinal = nullptr) {
    int32_t ord = -1;
    int rc = tsock_reader_open_device(r_, &ord);
    if (rc == TSOCK_ENODEVICE) return false;
    detail::check(rc, "tsock_reader_open_device");
    if (cuda_ordinal != nullptr) *cuda_ordinal = ord;
    return true;
  }

  /* Registers the payload mapping as pinned memory (tsock_reader_register_host). */
  void register_host() { detail::check(tsock_reader_register_host(r_), "tsock_reader_register_host"); }

  void detach() {
    if (r_ != nullptr) detail::check(tsock_reader_detach(std::exchange(r_, nullptr)), "tsock_reader_detach");
  }

  tsock_reader_t *get() const noexcept { return r_; }
  explicit operator bool() const noexcept { return r_ != nullptr; }

 private:
  void reset() noexcept {
    if (r_ != nullptr) tsock_reader_detach(std::exchange(r_, nullptr));
  }

  tsock_reader_t *r_ = nullptr;
  bool closed_ = false;
};

/* The producer of a channel (libtsock.so). */
class Producer {
 public:
  /* Defaults of tsock_producer_options_init(), to change before creating. */
  static tsock_producer_options_t options() noexcept {
    tsock_producer_options_t o;
    tsock_producer_options_init(&o);
    return o;
  }

  Producer() noexcept = default;
  explicit Producer(const std::string &name) : Producer(name, options()) {}
  Producer(const std::string &name, const tsock_producer_options_t &opts) {
    detail::check(tsock_producer_create(name.c_str(), &opts, &p_), "tsock_producer_create");
  }
  Producer(Producer &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Producer &operator=(Producer &&o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Producer(const Producer &) = delete;
  Producer &operator=(const Producer &) = delete;
  /* Closes the channel: readers drain it, then see it closed. */
  ~Producer() { reset(); }

  /* The payload buffer of the next batch, nbytes long. Throws Error with
   * TSOCK_EBACKPRESSURE (timeout 0) or TSOCK_ETIMEDOUT when the ring stays full. */
  void *reserve(uint64_t nbytes, int64_t timeout_ns = -1) {
    void *buf = nullptr;
    detail::check(tsock_producer_reserve(p_, nbytes, timeout_ns, &buf), "tsock_producer_reserve");
    return buf;
  }

  void publish(const tsock_tensor_t *tensors, uint32_t n, const void *meta = nullptr,
               uint32_t meta_len = 0) {
    detail::check(tsock_producer_publish(p_, tensors, n, meta, meta_len), "tsock_producer_publish");
  }
  void publish(std::initializer_list<tsock_tensor_t> tensors, const void *meta = nullptr,
               uint32_t meta_len = 0) {
    publish(tensors.begin(), static_cast<uint32_t>(tensors.size()), meta, meta_len);
  }

  void abort() { detail::check(tsock_producer_abort(p_), "tsock_producer_abort"); }
  void end_epoch(int64_t timeout_ns = -1) {
    detail::check(tsock_producer_end_epoch(p_, timeout_ns), "tsock_producer_end_epoch");
  }
  void wait_readers(uint32_t n, int64_t timeout_ns = -1) {
    detail::check(tsock_producer_wait_readers(p_, n, timeout_ns), "tsock_producer_wait_readers");
  }
  tsock_producer_stats_t stats() const {
    tsock_producer_stats_t s{};
    s.size = sizeof s;
    detail::check(tsock_producer_stats(p_, &s), "tsock_producer_stats");
    return s;
  }

  void close() {
    if (p_ != nullptr) detail::check(tsock_producer_close(std::exchange(p_, nullptr)), "tsock_producer_close");
  }

  tsock_producer_t *get() const noexcept { return p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  void reset() noexcept {
    if (p_ != nullptr) tsock_producer_close(std::exchange(p_, nullptr));
  }

  tsock_producer_t *p_ = nullptr;
};

}  // namespace tsock

#endif /* TSOCK_HPP */
