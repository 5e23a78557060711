"""Reports what the user's PYTHONPATH and sitecustomize provided inside the child."""

import builtins
import os
import sys

import user_module  # found only through the user's PYTHONPATH

print(f"user_module={user_module.VALUE}")
print(f"user_sitecustomize={getattr(builtins, 'USER_SITECUSTOMIZE_RAN', False)}")
print(f"pythonpath={os.environ['PYTHONPATH']}")
print(f"sys_path={':'.join(sys.path[1:])}", flush=True)
