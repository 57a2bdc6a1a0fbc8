"""Layer 2, costmodel: the vocabulary of the cost model, shared by the schemes' byte models, the planner
and the simulator: a sync's sizes and predicted bytes (:mod:`.shape`), the alpha-beta cost model
(:mod:`.cost`), support estimates from the handshake's sketches (:mod:`.support`), every rank's
row ids without values (:mod:`.supports`), a sync's exact collectives on them
(:mod:`.traffic`) and local op rates of devices measured elsewhere (:mod:`.profiles`)."""
