"""The parts of `tpustrat.launch` (the one-machine multi-process launcher) behind its command line:

* `processes`: starting a process (its environment, the bootstrap that ties it to the launcher), what the
  launcher remembers of it, its output, the order in which the processes end, the signals;
* `reports`: which process failed first and how, what became of the others, the launcher's exit status.

`tpustrat.launch` keeps the command line, `launch` (starts, restarts, the deadline) and `main`.
"""
