"""Layer 6, features built on the sync: gradient compression (top-k, DGC, threshold) with error
feedback (:mod:`.compression`), DS-Sync's shuffled parameter sync (:mod:`.ds_sync`), and the
batch-cost embedding lookup for partitioned tables (:mod:`.row_embedding`), and the embedding
backward that hands a whole table's weight the batch's rows (:mod:`.row_grad`)."""
