"""Generation in the training process, shaped like TRL's ``trl/generation/``: the server-mode generation class with
TRL's contract (:mod:`.server`, built from :mod:`.settings`), one verified push (:mod:`.push`) through one weight
transport (:mod:`.transport`: :mod:`.disk`, :mod:`.s3`), the first-batch check (:mod:`.first_batch`), which replica
sampled which row (:mod:`.replica_rows`), and how first turns are sampled, now or ahead (:mod:`.async_rollouts`,
around the async producer, :mod:`.prefetch`)."""
