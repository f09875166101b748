"""The CPU wing: what makes decoding fast on a CPU, behind one seam (platforms.Cpu). backend (kernels.Backend's calls
by the CPU's kernels), native (the compiled C kernels and their references), formats (w4a8, oneDNN's packing, a
model file made into a model), auto (--weights auto's measuring), weight_cache (converted weights kept on disk),
store (what those share)."""
