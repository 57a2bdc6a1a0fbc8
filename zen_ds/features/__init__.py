"""Layer 6, features built on the sync: gradient compression (top-k, DGC, threshold) with error
feedback (:mod:`.compression`), and DS-Sync's shuffled parameter sync (:mod:`.shuffle`,
:mod:`.shuffle_sync`)."""
