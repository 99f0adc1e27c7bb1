"""TFDS image datasets (array_record, no TensorFlow): prepared from an image folder or written by
a TFDS builder like mnist's, read back exactly, trained on; chunked evaluation; clear errors."""

import io
import pathlib

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from diloco_jax import tasks
from diloco_jax.config import ConfigError, apply_overrides, load_preset, validate
from diloco_jax.data import DataError, tfds_images, tfds_io
from diloco_jax.data.images import load_digits, sample_images
from diloco_jax.data.prepare import main as prepare_main
from diloco_jax.data.sources import load_images
from diloco_jax.tasks import vision
from diloco_jax.train import train
from tests.helpers import events


def png(pixels_HxWxC: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels_HxWxC.squeeze(-1) if pixels_HxWxC.shape[-1] == 1 else pixels_HxWxC
                    ).save(out, format="PNG")  # fmt: skip
    return out.getvalue()


@pytest.fixture(scope="module")
def digit_folder(tmp_path_factory):
    """The shipped digits as PNG files, one folder per class: ``(folder, pixels, labels)``."""
    digits_Nx8x8, labels_N = load_digits()
    pixels_Nx8x8 = digits_Nx8x8 * np.uint8(15)  # 0..16 -> 0..240
    folder = tmp_path_factory.mktemp("digit_pngs")
    for i, (pixels, label) in enumerate(zip(pixels_Nx8x8, labels_N, strict=True)):
        (folder / f"class_{label}").mkdir(exist_ok=True)
        Image.fromarray(pixels).save(folder / f"class_{label}" / f"{i:04d}.png")
    return folder, pixels_Nx8x8[..., None], labels_N


@pytest.fixture(scope="module")
def data_dir(digit_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("tfds_images")
    tfds_images.prepare(digit_folder[0], out, name="digit_pngs", val_fraction=0.2)
    return out


def test_prepared_folder_reads_back_exactly(digit_folder, data_dir):
    _, pixels_Nx8x8x1, labels_N = digit_folder
    imgs = load_images("tfds:digit_pngs", val_fraction=0.5, data_dir=str(data_dir))  # own split
    assert imgs.train_images.dtype == np.uint8 and imgs.train_images.shape[1:] == (8, 8, 1)
    assert imgs.num_classes == 10
    # every image comes back bit for bit with its label, each in exactly one split
    written = sorted((p.tobytes(), int(y)) for p, y in zip(pixels_Nx8x8x1, labels_N, strict=True))
    pixels = np.concatenate([imgs.train_images, imgs.val_images])
    labels = np.concatenate([imgs.train_labels, imgs.val_labels])
    read = sorted((p.tobytes(), int(y)) for p, y in zip(pixels, labels, strict=True))
    assert read == written
    # 20% of each class is held out; the training order is shuffled (no class-sorted shards)
    per_class = np.bincount(labels_N, minlength=10)
    np.testing.assert_array_equal(np.bincount(imgs.val_labels), np.round(per_class * 0.2))
    assert len(set(imgs.train_labels[:100].tolist())) == 10
    names = tfds_io.open_splits("tfds:digit_pngs", str(data_dir)).features["label"].names
    assert names == [f"class_{k}" for k in range(10)]  # ClassLabel names: the folders


def test_uint8_images_sample_as_floats_in_unit_range(data_dir):
    imgs = load_images("tfds:digit_pngs", val_fraction=0.1, data_dir=str(data_dir))
    shard = (jnp.asarray(imgs.train_images), jnp.asarray(imgs.train_labels))
    images, labels = sample_images(shard, seed=1, replica=0, step=5, batch_size=16)
    assert images.dtype == jnp.float32 and float(images.max()) <= 1.0
    # the same examples as the uint8 ones, divided by 255
    idx = [np.flatnonzero((imgs.train_images == np.round(np.asarray(im) * 255)).all((1, 2, 3)))
           for im in images]  # fmt: skip
    assert all(len(i) >= 1 for i in idx)
    assert all(labels[k] in imgs.train_labels[i] for k, i in enumerate(idx))


def write_mnist_like(
    data_dir: pathlib.Path,
    name: str,
    *,
    hwc=(12, 12, 1),
    classes=3,
    sizes=None,
    counts=(("train", 60), ("test", 20)),
):
    """A dataset with mnist's layout (image, ClassLabel label, train/test) plus an extra id
    feature, written the way any TFDS builder writes it: encoded images. ``sizes``: images
    alternate between these (height, width), the feature's shape is (None, None, C)."""
    import tensorflow_datasets as tfds

    rng = np.random.default_rng(0)
    channels = hwc[-1]
    examples = {}
    for split, n in counts:
        pix = [rng.integers(0, 256, (*(sizes[i % 2] if sizes else hwc[:2]), channels),
                            dtype=np.uint8) for i in range(n)]  # fmt: skip
        examples[split] = [(i, {"image": png(p), "label": i % classes, "id": f"{split}{i}"})
                           for i, p in enumerate(pix)]  # fmt: skip

    def features():
        return tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, channels) if sizes else hwc),
            "label": tfds.features.ClassLabel(num_classes=classes),
            "id": tfds.features.Text(),
        })  # fmt: skip

    tfds_io.write(name, data_dir, features, {s: (lambda e=e: iter(e)) for s, e in examples.items()})
    return examples


def test_a_builder_written_dataset_with_a_test_split(tmp_path):
    examples = write_mnist_like(tmp_path, "mnist_like")
    imgs = tfds_images.load("tfds:mnist_like", str(tmp_path))
    assert imgs.num_classes == 3 and imgs.val_images.shape == (20, 12, 12, 1)
    # validation keeps the stored order; every test image decodes to its pixels
    stored = {e["image"]: e["label"] for _, e in examples["test"]}
    assert sorted(stored.values()) == sorted(imgs.val_labels.tolist())
    for image, label in zip(imgs.val_images, imgs.val_labels, strict=True):
        assert stored[png(image)] == label  # PNG is lossless: re-encoding gives the same bytes


def test_images_of_several_sizes_need_image_size(tmp_path):
    write_mnist_like(tmp_path, "sizes", hwc=(0, 0, 3), sizes=[(10, 14), (9, 9)])
    with pytest.raises(DataError, match="different sizes .*data.image_size"):
        tfds_images.load("tfds:sizes", str(tmp_path))
    imgs = tfds_images.load("tfds:sizes", str(tmp_path), image_size=8)
    assert imgs.train_images.shape == (60, 8, 8, 3) and imgs.val_images.shape == (20, 8, 8, 3)


def test_bad_features_are_named(tmp_path):
    write_mnist_like(tmp_path, "feats")
    listed = ".*'id', 'image', 'label'"  # the dataset's features
    with pytest.raises(DataError, match="no feature 'img' for data.image_feature " + listed):
        tfds_images.load("tfds:feats", str(tmp_path), image_feature="img")
    with pytest.raises(DataError, match="no feature 'class' for data.label_feature " + listed):
        tfds_images.load("tfds:feats", str(tmp_path), label_feature="class")
    with pytest.raises(DataError, match="feature 'id' .* is not an image"):
        tfds_images.load("tfds:feats", str(tmp_path), image_feature="id")
    with pytest.raises(DataError, match="not found in .*--images DIR"):
        tfds_images.load("tfds:absent", str(tmp_path))


def test_chunked_eval_equals_one_pass():
    graphdef, params = vision.init_model(0, channels=1, num_classes=3, width=4, stages=1, depth=1)
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 256, (23, 6, 6, 1), dtype=np.uint8), rng.integers(0, 3, 23))
    whole = tasks.image_classification(graphdef, chunk=64).eval_fn(params, data)
    chunked = tasks.image_classification(graphdef, chunk=5).eval_fn(
        params, data
    )  # 5 chunks, 2 padded rows
    chex.assert_trees_all_close(chunked, whole, atol=1e-6)
    logits = vision.apply(graphdef, params, data[0].astype(np.float32) / 255)
    np.testing.assert_allclose(whole["accuracy"], (logits.argmax(-1) == data[1]).mean())


@pytest.mark.slow  # ~25 s; the cifar10 preset on a prepared dataset stays in the default suite
def test_train_on_a_prepared_image_folder(data_dir, tmp_path):
    overrides = {"data.corpus": "tfds:digit_pngs", "data.data_dir": str(data_dir),
                 "train.total_steps": 60, "train.eval_every": 60, "train.log_every": 20,
                 "outer.sync_every": 20, "train.checkpoint": False,
                 "parallel.runtime": "mesh", "parallel.replica_devices": 4}  # fmt: skip
    cfg = apply_overrides(load_preset("configs/digits.py"),
                          [(k, str(v)) for k, v in overrides.items()])  # fmt: skip
    done = train(cfg, tmp_path, show_progress=False)
    evals = events(tmp_path, "eval")
    # 10 classes: chance is 0.1 accuracy and log(10) = 2.30 nats
    assert evals[-1]["accuracy"] > 0.3 and done["final_eval_loss"] < np.log(10)
    assert done["unit"] == "example"


def test_prepare_images_cli(digit_folder, tmp_path, capsys):
    folder = digit_folder[0]
    assert prepare_main(["--images", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert f"--images {tmp_path / 'none'}: no such folder" in capsys.readouterr().err
    one = tmp_path / "one" / "only"
    one.mkdir(parents=True)
    assert prepare_main(["--images", str(one.parent), "--out", str(tmp_path)]) == 2
    assert "one subfolder of images per class" in capsys.readouterr().err
    mixed = tmp_path / "mixed"  # class c1 in colour: the dataset is RGB
    for k, shape in enumerate([(8, 8), (9, 7, 3)]):
        (mixed / f"c{k}").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full(shape, 40 * k, np.uint8)).save(mixed / f"c{k}" / f"{i}.png")
    assert prepare_main(["--images", str(mixed), "--out", str(tmp_path)]) == 2
    assert "different sizes" in capsys.readouterr().err
    (mixed / "c1" / "broken.png").write_bytes(b"not a png")
    assert prepare_main(["--images", str(mixed), "--out", str(tmp_path), "--size", "6"]) == 2
    assert "broken.png" in capsys.readouterr().err
    (mixed / "c1" / "broken.png").unlink()
    assert prepare_main(["--images", str(mixed), "--out", str(tmp_path), "--size", "6",
                         "--name", "mixed"]) == 0  # fmt: skip
    assert "4 training and 2 validation images of 6x6x3, 2 classes" in capsys.readouterr().out
    # preparing a name again replaces its records
    assert prepare_main(["--images", str(mixed), "--out", str(tmp_path), "--size", "4",
                         "--name", "mixed"]) == 0  # fmt: skip
    assert "images of 4x4x3" in capsys.readouterr().out
    imgs = tfds_images.load("tfds:mixed", str(tmp_path))
    assert imgs.train_images.shape == (4, 4, 4, 3) and imgs.val_images[..., 0].max() == 40
    with pytest.raises(SystemExit):  # an option of the other kind is refused, not ignored
        prepare_main(["--images", str(mixed), "--out", str(tmp_path), "--tokenizer", "byte",
                      "--record_tokens", "9"])  # fmt: skip
    assert "--record_tokens does not apply to --images" in capsys.readouterr().err
    # predefined splits: DIR/train/CLASS and DIR/val/CLASS
    splits = tmp_path / "splits"
    (splits / "train").mkdir(parents=True)
    assert prepare_main(["--images", str(splits), "--out", str(tmp_path), "--name", "sp"]) == 2
    assert "a train folder but no validation, val or test folder" in capsys.readouterr().err
    for split, n in (("train", 4), ("val", 2)):
        for k in range(2):
            (splits / split / f"c{k}").mkdir(parents=True, exist_ok=True)
            for i in range(n):
                src = next((folder / f"class_{k}").iterdir())
                (splits / split / f"c{k}" / f"{i}.png").write_bytes(src.read_bytes())
    assert prepare_main(["--images", str(splits), "--out", str(tmp_path), "--name", "sp"]) == 0
    assert "8 training and 4 validation images of 8x8x1" in capsys.readouterr().out


def test_cifar10_preset_on_a_cifar10_shaped_dataset(tmp_path):
    from diloco_jax.config import problems

    write_mnist_like(tmp_path, "cifar10", hwc=(32, 32, 3), classes=10,
                     counts=(("train", 40), ("test", 10)))  # fmt: skip
    cfg = apply_overrides(load_preset("configs/cifar10.py"), [("data.data_dir", str(tmp_path))])
    problem = problems.load(cfg, replicas=cfg.parallel.replicas)
    images_RxSxHxWxC, labels_RxS = problem.shards
    assert images_RxSxHxWxC.shape == (4, 10, 32, 32, 3) and images_RxSxHxWxC.dtype == np.uint8
    assert problem.task.unit == "example" and problem.baseline_nats == np.log(10)
    metrics = problem.task.eval_fn(problem.params, problem.eval_data)  # 10 classes, untrained
    assert 0 <= float(metrics["accuracy"]) <= 1 and np.isfinite(float(metrics["eval_loss"]))


def test_splits_by_name_and_slice(tmp_path):
    write_mnist_like(tmp_path, "train_only", counts=(("train", 60),))
    with pytest.raises(DataError, match=r"no split 'test' for data.eval_split .*\['train'\]"):
        tfds_images.load("tfds:train_only", str(tmp_path))
    imgs = tfds_images.load("tfds:train_only", str(tmp_path), train_split="train[:80%]",
                            eval_split="train[80%:]")  # fmt: skip
    assert len(imgs.train_labels) == 48 and len(imgs.val_labels) == 12
    whole = tfds_images.load("tfds:train_only", str(tmp_path), eval_split="train")
    # the two slices partition the split: every image once
    sliced = np.concatenate([imgs.train_images, imgs.val_images])
    assert sorted(map(bytes, sliced)) == sorted(map(bytes, whole.val_images))
    with pytest.raises(DataError, match="is empty"):
        tfds_images.load("tfds:train_only", str(tmp_path), eval_split="train[100%:]")
    with pytest.raises(DataError, match=r"no split .train\+nope. for data.eval_split"):
        tfds_images.load("tfds:train_only", str(tmp_path), eval_split="train+nope")
    # the config keys reach the loader: a train-only image dataset is still image data
    from diloco_jax.config import problems

    cfg = apply_overrides(load_preset("configs/digits.py"), [
        ("data.corpus", "tfds:train_only"), ("data.data_dir", str(tmp_path)),
        ("data.train_split", "train[:80%]"), ("data.eval_split", "train[80%:]")])  # fmt: skip
    problem = problems.load(cfg, replicas=4)
    assert problem.task.unit == "example" and problem.shards[1].shape == (4, 12)
    assert problem.eval_data[1].shape == (12,)
    with pytest.raises(ConfigError, match="only TFDS datasets"):
        validate(apply_overrides(load_preset("configs/digits.py"), [("data.eval_split", "test")]))


def test_configs_of_a_dataset(data_dir, tmp_path):
    import shutil

    for config in ("small", "large"):  # NAME/CONFIG/VERSION, as tfds build writes configs
        shutil.copytree(data_dir / "digit_pngs", tmp_path / "multi" / config)
    with pytest.raises(DataError, match=r"has configs \['large', 'small'\]: name one"):
        tfds_images.load("tfds:multi", str(tmp_path))
    imgs = tfds_images.load("tfds:multi/small", str(tmp_path))
    assert imgs.num_classes == 10 and imgs.train_images.shape[1:] == (8, 8, 1)


def test_sixteen_bit_grayscale_keeps_its_top_byte():
    wide = Image.fromarray(np.array([[0, 1000], [30000, 65535]], np.uint16))
    assert wide.mode.startswith("I")
    pixels = np.asarray(tfds_images._normalized(wide, 1, 0))
    np.testing.assert_array_equal(pixels, [[0, 1000 >> 8], [30000 >> 8, 255]])


BUDGET_MIB = 0.05  # the digit PNGs' training images take 92 KB: more than this


def test_training_images_over_the_budget_stream_from_an_image_file(data_dir):
    """Over data.max_memory_mib the training split is decoded once into a uint8 image file in
    the loaded run's (shuffled) order and memory-mapped; a second load reuses it; a split that
    fits stays in memory."""
    where = {"val_fraction": 0.1, "data_dir": str(data_dir)}
    loaded = load_images("tfds:digit_pngs", **where)
    streamed = load_images("tfds:digit_pngs", **where, max_bytes=int(BUDGET_MIB * 2**20))
    assert isinstance(streamed.train_images, np.memmap)
    assert not isinstance(loaded.train_images, np.memmap)
    for got, want in zip(streamed, loaded, strict=True):
        np.testing.assert_array_equal(got, want)
    path = data_dir / "digit_pngs" / "_images-train.npy"
    written = path.stat().st_mtime_ns
    again = load_images("tfds:digit_pngs", **where, max_bytes=1000)
    assert path.stat().st_mtime_ns == written  # reused, not rewritten
    np.testing.assert_array_equal(again.train_labels, loaded.train_labels)
    resized = load_images("tfds:digit_pngs", **where, max_bytes=1000, image_size=4)
    assert resized.train_images.shape[1:] == (4, 4, 1)  # another size: written again
    assert path.stat().st_mtime_ns != written
    fits = load_images("tfds:digit_pngs", **where, max_bytes=10**9)
    assert not isinstance(fits.train_images, np.memmap)
    np.testing.assert_array_equal(fits.train_images, loaded.train_images)


def test_host_image_batches_equal_the_device_sampler(data_dir):
    from diloco_jax.data.images import image_shards
    from diloco_jax.data.stream import StreamedImages

    imgs = load_images("tfds:digit_pngs", val_fraction=0.1, data_dir=str(data_dir),
                       max_bytes=1000)  # fmt: skip
    images_RxS, labels_RxS = image_shards(imgs.train_images, imgs.train_labels, 4)
    assert isinstance(images_RxS, np.memmap)  # the shards are a view: nothing was read
    stream = StreamedImages(images_RxS, labels_RxS, seed=5, batch_size=6, num_steps=3)
    images, labels = stream.batches(7, range(1, 4))  # steps 7..9, replicas 1..3
    assert images.dtype == np.uint8 and images.shape == (3, 3, 6, 8, 8, 1)
    for n in range(3):
        for i, r in enumerate(range(1, 4)):
            shard = (np.asarray(images_RxS[r]), labels_RxS[r])
            want = sample_images(shard, seed=5, replica=np.int32(r), step=np.int32(7 + n),
                                 batch_size=6)  # fmt: skip
            np.testing.assert_array_equal(images[n, i] * np.float32(1 / 255), want[0])
            np.testing.assert_array_equal(labels[n, i], want[1])


def _digits_cfg(data_dir, budget, **overrides):
    overrides = {"data.corpus": "tfds:digit_pngs", "data.data_dir": str(data_dir),
                 "data.max_memory_mib": budget, "train.total_steps": 20, "train.eval_every": 10,
                 "train.log_every": 10, "outer.sync_every": 5, "data.batch_size": 16,
                 "resnet.width": 4, "resnet.stages": 1, "resnet.depth": 1, **overrides}  # fmt: skip
    return apply_overrides(load_preset("configs/digits.py"),
                           [(k, str(v)) for k, v in overrides.items()])  # fmt: skip


@pytest.mark.slow  # ~30 s: three runs; by default test_host_image_batches_equal_the_device_sampler
# (the batches) and test_stream's streamed text run (the loop's streamed path, resumed)
def test_a_streamed_image_run_trains_exactly_the_loaded_run_and_resumes(data_dir, tmp_path):
    from tests import helpers

    def cfg(budget):
        return _digits_cfg(data_dir, budget, **{"parallel.runtime": "sim"})

    setup = helpers.assert_streamed_equals_loaded(cfg, BUDGET_MIB, tmp_path)
    assert setup.shards_RxS[0].dtype == np.uint8  # uint8 pixels travel


@pytest.mark.slow  # ~40 s: the mesh and the chunked simulator, streamed images
@pytest.mark.parametrize("where", [
    {"parallel.runtime": "mesh", "parallel.replica_devices": 2, "parallel.data_devices": 2},
    {"parallel.runtime": "sim", "sim.chunk": 2, "sim.offload": True},
], ids=["mesh", "chunked"])  # fmt: skip
def test_streamed_images_on_the_mesh_and_in_chunks_train_the_loaded_run(data_dir, tmp_path,
                                                                        where):  # fmt: skip
    import jax

    off = {"train.checkpoint": False, **where}
    runs = [train(_digits_cfg(data_dir, budget, **off), tmp_path / str(budget),
                  show_progress=False)["state"] for budget in (0, BUDGET_MIB)]  # fmt: skip
    chex.assert_trees_all_equal(*jax.device_get(runs))
