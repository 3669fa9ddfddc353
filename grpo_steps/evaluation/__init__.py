"""The evaluation stage: one policy's evaluation on held-out rows (:mod:`.policy`: sample, score, summarise), its
statistics (:mod:`.stats`), its scoring with the training rewards (:mod:`.scoring`), its rollouts (:mod:`.episodes`),
baseline against trained policy (:mod:`.comparison`) and what a person reads of it (:mod:`.report`)."""
