import sys, tempfile, torch, os
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
import datastates
state={f"t{i}": torch.randn(2) for i in range(1000)}
root=sys.argv[1]
with datastates.Checkpointer(root) as ck:
    ck.save(state, step=0).wait()
    os.write(2, b"=====MARK=====\n")
    ck.save(state, step=1).wait()
    os.write(2, b"=====END=====\n")
