// reader.cpp - examples/c/reader.c in C++ with tsock.hpp.
// Usage: reader_cpp NAME
#include <cstdio>

#include "tsock.hpp"

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s NAME\n", argv[0]);
    return 2;
  }
  try {
    auto opts = tsock::Reader::options();
    opts.attach_timeout_ns = 10'000'000'000;  // the producer may start after us
    tsock::Reader reader(argv[1], opts);

    long long batches = 0, samples = 0, label_sum = 0;
    while (auto b = reader.acquire()) {  // std::nullopt once the channel is closed
      if (b->epoch_end()) {
        std::printf("epoch %llu: %lld batches, %lld samples, label sum %lld\n",
                    static_cast<unsigned long long>(b->epoch()), batches, samples, label_sum);
        batches = samples = label_sum = 0;
      } else {
        const int64_t *labels = b->data<int64_t>(1);
        for (int64_t i = 0; i < (*b)[1].shape[0]; i++) label_sum += labels[i];
        samples += (*b)[0].shape[0];
        batches++;
      }
      reader.release(*b);
    }
  } catch (const tsock::Error &e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
