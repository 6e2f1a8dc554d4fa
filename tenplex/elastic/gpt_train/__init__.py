"""The copy of ``examples/01-gpt-train``'s ``train.py`` and ``record.py`` that ``tenplex demo --elastic`` runs.

An installed package has no ``examples/`` folder; the demo runs ``train.py``
here by its path (it imports ``record`` as its neighbour, like the example),
never as an import. ``examples/01-gpt-train`` stays the copy users read and
edit; a test keeps the two identical (``tests/test_demo_installed.py``).

May import: nothing (the scripts import ``tenplex.elastic`` and ``tenplex.models`` when run).
"""
