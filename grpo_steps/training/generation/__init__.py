"""Generation in the training process, shaped like TRL's ``trl/generation/``: the server-mode generation class with
TRL's contract (:mod:`.server`), one verified push (:mod:`.push`) of the disk push files (:mod:`.disk`), the
first-batch check (:mod:`.first_batch`), which replica sampled which row (:mod:`.replica_rows`) and the async
prefetcher (:mod:`.prefetch`)."""
