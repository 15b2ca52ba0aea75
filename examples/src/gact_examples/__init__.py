"""Shared code of the GACT example scripts.

The scripts a user runs sit beside this package (``examples/gnn/train_gnn.py``,
``examples/vision/train_vision.py``, ``examples/text/train_char_gpt.py``, ``examples/demo.py``,
``examples/bench.py``); what they share lives here:

* :mod:`gact_examples.data` - loaders for the on-disk formats (nothing is ever downloaded);
* :mod:`gact_examples.models` - GCN/GraphSAGE/GAT, a small ResNet, a character GPT;
* :mod:`gact_examples.train` - the common command line and :class:`~gact_examples.train.Run`,
  the bookkeeping of one training run (GACT controller, step times, memory, JSON record);
* :mod:`gact_examples.memory` - peak-memory measurement on CPU and CUDA;
* :mod:`gact_examples.runs`, :mod:`gact_examples.levels`, :mod:`gact_examples.charts` - running
  scripts in subprocesses, level names, bar charts (used by the demo and the benchmark);
* :mod:`gact_examples.bench` - the benchmark's example specs, tables and plots;
* :mod:`gact_examples.testing` - tiny datasets in the real on-disk formats, for tests.

Install it with the three GACT packages: ``pip install ./packages/gact-kernels
./packages/gact-policy ./packages/gact-runtime ./examples`` (see ``examples/README.md``).
"""

from __future__ import annotations

__all__: list[str] = []
