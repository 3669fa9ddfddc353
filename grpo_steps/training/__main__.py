"""``python -m grpo_steps.training JOB.json``: the training process (see :mod:`grpo_steps.training.entry`)."""

if __name__ == "__main__":
    from grpo_steps.training.entry import main

    main()
