"""`python -m flux_train.train`: the command of flux_train.training.train (kept where users type it). It hands the
trainer the sampler of eval.sample_prompts (flux_train.tools.sample), which training may not import."""

from flux_train.cli import answer_early, train_parser

if __name__ == "__main__":
    answer_early(train_parser())  # before flux_train.training.train loads
    from flux_train.tools.sample import Sampler
    from flux_train.training.train import main

    raise SystemExit(main(sampler=Sampler.for_run))
