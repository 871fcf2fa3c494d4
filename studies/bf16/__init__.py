"""The fidelity cost of bfloat16 compute for FusionRAG 15% (README.md; run.sh, summarize.py)."""
