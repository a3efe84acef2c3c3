"""The health wing: what keeps a job honest about its ranks and nodes, apart from what a person
reads (dsslm/observe/). `door.Health` is the one object the training loop talks to; behind it
the watchdog (hangs, reaper), the node check (nodecheck, nodes, exclude) and the straggler report."""
