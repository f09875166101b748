"""The CPU wing: what makes decoding fast on a CPU, behind one seam. native (the compiled C kernels and their
references), auto (--weights auto's measuring), weight_cache (converted weights kept on disk), store (what those share)."""
