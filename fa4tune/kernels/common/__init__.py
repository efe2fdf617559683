"""Host-side pieces shared by the attention families: input checks, per-stream tile counters,
prepared launches, the fp32 reference and the output checks of the measuring worker."""
