"""Local runtime: simulated hosts (one store process each) and worker processes on this machine.

May import: the standard library and ``tenplex`` layers below the CLI. ``hosts`` and
``launch`` only start processes (no torch); ``demo_worker`` is the training job the
processes run and imports torch and the reference GPT (``tenplex.models``); ``demo`` orchestrates the
``tenplex demo`` scenario and checks its results from the workers' JSON and
safetensors files (nothing crosses a process boundary as a pickle).
"""
