"""A process that learns and saves into a pair's profile, for tests/test_profile_lock.py.

    python profile_writer.py DRAFT TARGET PROFILE TAG SAVES GO [HELD RELEASE]

Loads the profile, prints "loaded", waits for the file GO, then SAVES times: adds an n-gram and
three head labels of its own (marked by TAG), sets every adapter weight to TAG
and saves one drafter update. With HELD and RELEASE, its last save stops just
before writing the manifest (its new files written, the lock held), creates
HELD and waits for RELEASE.
"""

import os
import sys
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm import load

import omnidraft_mlx.profile.store as profile_module
from omnidraft_mlx.decode.policy import LearnedPolicy, PolicyConfig
from omnidraft_mlx.learn.distill import DistillConfig, setup_trainable
from omnidraft_mlx.profile.store import load_profile


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


def hold_before_manifest(held: str, release: str) -> None:
    write = profile_module.atomic_write_text

    def held_write(path, text):
        if path.name == profile_module.MANIFEST:
            open(held, "w").close()
            wait_for(release)
        write(path, text)

    profile_module.atomic_write_text = held_write


def main(draft, target, path, tag, saves, go, held=None, release=None):
    tag, saves = int(tag), int(saves)
    model, _ = load(draft)
    profile = load_profile(draft, target, model, trainable=True, path=path)
    if not profile.distill:
        setup_trainable(model, DistillConfig(lora_rank=4))
    policy = profile.attach_policy(LearnedPolicy(PolicyConfig(name="learned")))
    print("loaded", flush=True)
    wait_for(go)
    for i in range(saves):
        profile.ngrams.add((1000 * tag + i, 7), tag)
        policy.head.learn(np.full((3, 4), 100 * tag + i, np.float32), [1, 0, 1], steps=0)
        model.update(tree_map(lambda a: mx.full(a.shape, float(tag)), model.trainable_parameters()))
        if held and i == saves - 1:
            hold_before_manifest(held, release)
        profile.save(
            model, distill=DistillConfig(lora_rank=4).__dict__, corpus="c", position=i + 1, record={"writer": tag}
        )
        print(i + 1, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
