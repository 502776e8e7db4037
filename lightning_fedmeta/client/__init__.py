"""The functional client primitives: what one client computes (ClientContext, losses, BatchNorm statistics), its random
draws, and how many clients run at once (loop, vmap, compiled, CUDA graphs)."""
