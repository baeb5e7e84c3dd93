/* reader.c - reads every batch of a channel until its producer closes it,
 * printing a line per epoch. Links libtsock_reader.so (no Go runtime).
 * Usage: reader NAME */
#include <stdio.h>

#include "tsock.h"

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s NAME\n", argv[0]);
    return 2;
  }
  tsock_reader_options_t opts;
  tsock_reader_options_init(&opts);
  opts.attach_timeout_ns = 10 * 1000000000LL; /* the producer may start after us */
  tsock_reader_t *r;
  int rc = tsock_reader_attach(argv[1], &opts, &r);
  if (rc != TSOCK_OK) {
    fprintf(stderr, "attach: %s (%s)\n", tsock_status_str(rc), tsock_last_error());
    return 1;
  }

  long long batches = 0, samples = 0, label_sum = 0;
  const tsock_batch_t *b;
  /* Timeout -1: wait as long as it takes; a dead producer still ends the wait. */
  while ((rc = tsock_reader_acquire(r, &b, -1)) == TSOCK_OK) {
    if (b->flags & TSOCK_BATCH_EPOCH_END) {
      printf("epoch %llu: %lld batches, %lld samples, label sum %lld\n",
             (unsigned long long)b->epoch, batches, samples, label_sum);
      batches = samples = label_sum = 0;
    } else {
      const tsock_tensor_t *y = &b->tensors[1]; /* labels, int64 [rows] */
      const int64_t *labels = y->data;
      for (int64_t i = 0; i < y->shape[0]; i++) label_sum += labels[i];
      samples += b->tensors[0].shape[0];
      batches++;
    }
    tsock_reader_release(r, b); /* lets the producer reuse the slot */
  }
  if (rc != TSOCK_ECLOSED) fprintf(stderr, "acquire: %s (%s)\n", tsock_status_str(rc), tsock_last_error());
  tsock_reader_detach(r);
  return rc == TSOCK_ECLOSED ? 0 : 1;
}
