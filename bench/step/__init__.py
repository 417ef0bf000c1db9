"""`moe-serve bench step`: where a decode step's time goes and what each decode-path switch of the
plugin's config saves, at kernel level (each fused piece against the unfused chain it replaces, in
CUDA graphs) and at model level (the yardstick's servers, one process per switch set, profiled)."""
