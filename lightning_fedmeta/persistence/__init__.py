"""What is stored: the client state stores (memory, disk), atomic file writes, checkpoint checksums, atomic checkpoint
I/O and data-only checkpoint reads."""
