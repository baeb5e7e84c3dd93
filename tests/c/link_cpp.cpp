// link_cpp.cpp - a C++ program built with default flags against one tsock
// library, through tsock.hpp. Built twice:
//   against libtsock.so:        a producer -> reader roundtrip in one process;
//   against libtsock_reader.so: (TSOCK_READER_ONLY) attach to a missing channel.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tsock.hpp"

static int failures = 0;
#define EXPECT(c)                                                       \
  do {                                                                  \
    if (!(c)) {                                                         \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #c); \
      failures++;                                                       \
    }                                                                   \
  } while (0)

static std::string unique(const char *tag) {
  return "lcpp-" + std::to_string(getpid()) + "-" + tag;
}

static void missing_channel() {
  try {
    tsock::Reader r(unique("missing"));
    EXPECT(false);
  } catch (const tsock::Error &e) {
    EXPECT(e.status() == TSOCK_ENOENT);
    EXPECT(std::strstr(e.what(), "tsock_reader_attach") != nullptr);
  }
  try {
    tsock::Reader r("a/b");
    EXPECT(false);
  } catch (const tsock::Error &e) {
    EXPECT(e.status() == TSOCK_ENAME);
  }
  tsock::Reader none;
  EXPECT(!none);
  try {
    none.acquire(0);
    EXPECT(false);
  } catch (const tsock::Error &e) {
    EXPECT(e.status() == TSOCK_EHANDLE);
  }
  try {
    tsock::tensor(TSOCK_DTYPE_FLOAT32, {1, 2, 3, 4, 5, 6, 7, 8, 9});
    EXPECT(false);
  } catch (const tsock::Error &e) {
    EXPECT(e.status() == TSOCK_EDTYPE);
  }
}

#ifndef TSOCK_READER_ONLY
static void roundtrip() {
  const std::string name = unique("rt");
  auto po = tsock::Producer::options();
  po.slot_count = 4;
  po.slot_bytes = 4096;
  tsock::Producer producer(name, po);
  try {
    tsock::Producer second(name);
    EXPECT(false);
  } catch (const tsock::Error &e) {
    EXPECT(e.status() == TSOCK_EEXIST);
  }
  tsock::Reader reader(name);
  producer.wait_readers(1, 1'000'000'000);

  for (int i = 0; i < 3; i++) {
    auto *buf = static_cast<float *>(producer.reserve(6 * sizeof(float) + sizeof(int64_t)));
    for (int j = 0; j < 6; j++) buf[j] = float(i * 10 + j);
    int64_t label = 100 + i;
    std::memcpy(buf + 6, &label, sizeof label);
    producer.publish({tsock::tensor(TSOCK_DTYPE_FLOAT32, {2, 3}),
                      tsock::tensor(TSOCK_DTYPE_INT64, {}, 6 * sizeof(float))},
                     "meta", 4);
  }
  producer.end_epoch();
  try {
    producer.reserve(16, 0);  // 4 slots, none released yet
    EXPECT(false);
  } catch (const tsock::Error &e) {
    EXPECT(e.status() == TSOCK_EBACKPRESSURE);
  }
  EXPECT(producer.stats().published == 4);

  std::vector<float> seen;
  int markers = 0;
  tsock::KeptBatch label0;
  for (int k = 0; k < 4; k++) {
    auto b = reader.acquire(1'000'000'000);
    EXPECT(b.has_value());
    if (!b) return;
    if (k == 0) {
      label0 = reader.keep(*b, 1u << 1);  // the label, past its release
      EXPECT(label0 && label0.view().seq() == b->seq());
      EXPECT(label0.view().data<int64_t>(1) == b->data<int64_t>(1));
    }
    if (b->epoch_end()) {
      markers++;
      EXPECT(b->index() == 3 && b->size() == 0);
      try {  // an epoch-end marker has no tensor 0
        (void)b->data<float>(0);
        EXPECT(false);
      } catch (const tsock::Error &e) {
        EXPECT(e.status() == TSOCK_EINVAL);
      }
    } else {
      EXPECT(b->size() == 2 && b->index() == uint64_t(k));
      EXPECT((*b)[0].shape[0] == 2 && (*b)[0].shape[1] == 3);
      for (int j = 0; j < 6; j++) seen.push_back(b->data<float>(0)[j]);
      EXPECT(*b->data<int64_t>(1) == 100 + k);
      EXPECT(b->meta_size() == 4 && std::memcmp(b->meta(), "meta", 4) == 0);
      for (std::size_t past : {std::size_t(2), std::size_t(16), std::size_t(-1)}) {
        try {  // no tensor there: an error, never a read past the batch
          (void)(*b)[past];
          EXPECT(false);
        } catch (const tsock::Error &e) {
          EXPECT(e.status() == TSOCK_EINVAL && std::strstr(e.what(), "of a batch of 2") != nullptr);
        }
        try {
          (void)b->data<int64_t>(past);
          EXPECT(false);
        } catch (const tsock::Error &e) {
          EXPECT(e.status() == TSOCK_EINVAL);
        }
      }
      try {  // no device pool: no device copy
        b->cuda_use(0);
        EXPECT(false);
      } catch (const tsock::Error &e) {
        EXPECT(e.status() == TSOCK_ENODEVICE);
      }
    }
    reader.release(*b);
  }
  int32_t ordinal = 99;
  EXPECT(!reader.open_device(&ordinal) && ordinal == 99);  // host memory only
  EXPECT(markers == 1 && seen.size() == 18 && seen[17] == 25.0f);
  EXPECT(label0 && *label0.view().data<int64_t>(1) == 100);
  for (int i = 0; i < 3; i++) {
    producer.reserve(16, 0);
    producer.publish(nullptr, 0);
  }
  producer.close();
  producer.close();  // a closed wrapper is a no-op
  // The reader drains what was published before the close.
  int rest = 0;
  while (auto b = reader.acquire(1'000'000'000)) {
    rest++;
    reader.release(*b);
  }
  EXPECT(rest == 3 && reader.closed());
  tsock::Reader moved = std::move(reader);
  EXPECT(!reader && moved && moved.closed());
  moved.detach();
  EXPECT(!moved);
}
#endif

int main() {
  missing_channel();
#ifndef TSOCK_READER_ONLY
  try {
    roundtrip();
  } catch (const tsock::Error &e) {
    std::fprintf(stderr, "unexpected tsock::Error %d: %s\n", e.status(), e.what());
    failures++;
  }
#endif
  if (failures != 0) {
    std::fprintf(stderr, "link_cpp: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("link_cpp: all checks passed\n");
  return 0;
}
