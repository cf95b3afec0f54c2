"""``kvbm bench tiers``'s S3 rows (G2<->G4): each S3Tier client and plain aiobotocore next to boto3."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvbm.bench.common import boto3_client
from kvbm.bench.paired import Pair, PairRunner
from kvbm.bench.tiers_options import TiersOptions, tier_config
from kvbm.blocks import BlockKey


async def s3_rows(opts: TiersOptions, r: PairRunner, keys: list[BlockKey], data: list[np.ndarray], work: Path,
              srv: dict[str, Any], paths: dict[str, Any],
              after_round: Callable[[int], Awaitable[None]] | None = None) -> None:
    """kvbm's S3 rows, each S3Tier client and the aiobotocore reference run once per round (with their boto3
    baselines); ``after_round(r)`` runs after each round (the peer's pass). Every block each kvbm GET brought
    into G2 is compared with what was written, after the timed part, every round."""
    from kvbm.stack import build_stack

    n = len(keys)
    bodies = [a.tobytes() for a in data]
    raw_prefix = f"{srv['prefix']}/raw"
    cli = boto3_client(srv, pool=max(16, opts.boto3_threads * 2))
    pool = ThreadPoolExecutor(opts.boto3_threads, thread_name_prefix="bench-boto3")
    sink: list[bytes | None] = [None] * n
    thr = opts.boto3_threads

    def put_all() -> None:
        list(pool.map(lambda i: cli.put_object(Bucket=srv["bucket"], Key=f"{raw_prefix}/{i}", Body=bodies[i]),
                      range(n)))

    def get_one(i: int) -> None:
        sink[i] = cli.get_object(Bucket=srv["bucket"], Key=f"{raw_prefix}/{i}")["Body"].read()

    def get_all() -> None:
        list(pool.map(get_one, range(n)))

    def del_all() -> None:
        cli.delete_objects(Bucket=srv["bucket"], Delete={"Objects": [{"Key": f"{raw_prefix}/{i}"} for i in range(n)],
                                                         "Quiet": True})

    async def aio_reference(es: contextlib.AsyncExitStack) -> list[Pair]:
        """The S3Tier's own library without kvbm: aiobotocore put/get, same config, same concurrency."""
        import aiobotocore.session
        from aiobotocore.config import AioConfig

        cfg = AioConfig(max_pool_connections=max(10, opts.s3_concurrency * 2), s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        sem = asyncio.Semaphore(opts.s3_concurrency)
        sess = aiobotocore.session.get_session()
        c = await es.enter_async_context(sess.create_client(
            "s3", endpoint_url=srv["endpoint"], region_name="us-east-1", config=cfg,
            aws_access_key_id=srv["access_key"], aws_secret_access_key=srv["secret_key"]))

        async def put(i: int) -> None:
            async with sem:
                await c.put_object(Bucket=srv["bucket"], Key=f"{srv['prefix']}/aio/{i}", Body=bodies[i])

        async def get(i: int) -> None:
            async with sem:
                resp = await c.get_object(Bucket=srv["bucket"], Key=f"{srv['prefix']}/aio/{i}")
                async with resp["Body"] as stream:
                    sink[i] = await stream.read()

        async def put_all_aio() -> None:
            await asyncio.gather(*(put(i) for i in range(n)))

        async def get_all_aio() -> None:
            await asyncio.gather(*(get(i) for i in range(n)))

        c_ = opts.s3_concurrency
        return [
            Pair("G2->G4 PUT", f"aiobotocore put_object x{c_} (no kvbm)", put_all_aio, None,
                  f"boto3 put_object x{thr}", put_all, del_all),
            Pair("G4->G2 GET", f"aiobotocore get_object x{c_} (no kvbm)", get_all_aio, None,
                  f"boto3 get_object x{thr}", get_all),
        ]

    async def tier_pairs(mgr: Any, client: str) -> list[Pair]:
        for k, a in zip(keys, data, strict=True):
            await mgr.put(k, memoryview(a), tier="G2", cascade=False)

        async def drop_g4() -> None:
            await mgr.delete(keys, tiers=["G4"])

        async def put_g4() -> None:
            got = await mgr.offload(keys, durable=True)
            assert got == n, f"offload G2->G4 durable {got}/{n} (see the S3 tier's stats: shed/errors)"

        async def drop_g2() -> None:
            await mgr.delete(keys, tiers=["G2"])

        async def get_g4() -> None:
            got = await mgr.onboard(keys, to="G2")
            assert got == n, f"onboard G4->G2 moved {got}/{n}"

        async def compare() -> None:
            g2 = mgr.by_name["G2"]

            def same() -> list[int]:
                bad = []
                for i, (k, a) in enumerate(zip(keys, data, strict=True)):
                    with g2.hold(k) as t:
                        if t is None or not np.array_equal(t.numpy(), a):
                            bad.append(i)
                return bad

            bad = await asyncio.to_thread(same)
            assert not bad, f"G4 {client}: {len(bad)} of {n} blocks read back different (first: {bad[0]})"

        depth = {"s3_in_flight": opts.s3_concurrency}
        return [
            Pair("G2->G4 PUT", f"offload (S3Tier {client})", put_g4, drop_g4, f"boto3 put_object x{thr}", put_all,
                  del_all, extra=depth),
            Pair("G4->G2 GET", f"onboard (S3Tier {client})", get_g4, drop_g2, f"boto3 get_object x{thr}", get_all,
                  after=compare, extra=depth),
        ]

    try:
        put_all()  # warm the connections and the bucket's volumes once (not timed)
        async with contextlib.AsyncExitStack() as es:
            specs: list[Pair] = await aio_reference(es) if opts.s3_reference else []
            stacks: list[tuple[str, Any]] = []
            for client in opts.s3_clients:
                prefix = f"{srv['prefix']}/{client}"
                try:
                    stack = await build_stack(tier_config(opts, work, s3=srv, client=client, prefix=prefix),
                                              tiers=("G2", "G4"), index=False)
                except Exception as e:  # e.g. NIXL OBJ unavailable here
                    r.echo(f"  G4 {client}: skipped ({type(e).__name__}: {e})")
                    paths.setdefault("skipped", []).append(f"G4 {client}: {type(e).__name__}: {e}")
                    continue
                es.push_async_callback(stack.close)
                paths.setdefault("s3_clients", []).append(client)
                stacks.append((client, stack.manager))
                specs += await tier_pairs(stack.manager, client)
            await r.rounds(specs, after_round)
            for client, mgr in stacks:
                row = next(x for x in reversed(r.rows) if x["kvbm"] == f"onboard (S3Tier {client})")
                row["tier_stats"] = mgr.by_name["G4"].describe()["stats"]
                await mgr.delete(keys)
    finally:
        with contextlib.suppress(Exception):
            del_all()
        pool.shutdown(wait=True)
        cli.close()
