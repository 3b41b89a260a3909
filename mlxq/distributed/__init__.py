"""Serving one model from several processes over ``mx.distributed`` (tensor parallel).

world.py joins the group; channel.py moves small host values between ranks;
shard.py splits a loaded model with mlx-lm's ``shard()``; launch.py starts and
watches the local ranks of ``mlxq serve --tensor-parallel N``.
"""
