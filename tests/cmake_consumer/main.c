/* main.c - links an installed tsock library and makes a few calls. */
#include <stdio.h>
#include <string.h>

#include "tsock.h"

int main(void) {
  tsock_reader_t *r;
  int rc = tsock_reader_attach("no-such-consumer-channel", NULL, &r);
  if (rc != TSOCK_ENOENT) {
    fprintf(stderr, "attach: %d, want TSOCK_ENOENT\n", rc);
    return 1;
  }
#ifdef WITH_PRODUCER
  tsock_producer_t *p;
  if (tsock_producer_create("..", NULL, &p) != TSOCK_ENAME) return 1;
#endif
  printf("consumer ok: %s\n", tsock_status_str(rc));
  return 0;
}
