"""`raysb tune`: sweep files, the Ray Tune driver and the optional Optuna search."""
