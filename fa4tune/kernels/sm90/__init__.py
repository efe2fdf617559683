"""Hopper (sm_90a) device building blocks shared by kernel families: wgmma and layout helpers, the
online softmax, and exp2 on the MUFU or emulated on the FMA pipe (with its polynomial)."""
