"""The runner: joins the lifecycle, the scheduler and the engines.

The only package that imports across the others. ``loop`` takes jobs and runs each
alone (``alone``) or in a continuous batch (``continuous``), builds result records
(``records``) and feeds measurements back to the scheduler; ``runtime`` holds what
the CLI built (model cache, policy, limits) and passes down.
"""
