"""Reports of benchmarks and campaigns: tables and matplotlib figures (Agg backend, files only)."""
