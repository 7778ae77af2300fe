"""ImageNet training with torch's DataLoader: the baseline that `main.py` ports to shardloader.

Both files have the shape of pytorch/examples' `imagenet/main.py`: its arguments, `main()` and
`main_worker()`, SGD with StepLR, the `--resume` block before the data loaders are built, each
rank reading its share under torchrun, validation that all-reduces its meters and then reads on
every rank the samples that equal shares left out, a checkpoint from rank 0 at each epoch's end.
They train a tiny model on synthetic images so that they run on a CPU in seconds; GPU
selection, `mp.spawn` (torchrun starts the processes) and pretrained weights are left out.
`diff -u main_dataloader.py main.py` is the port: shardloader's Loader instead of DataLoader
and DistributedSampler, the Loader's state in every checkpoint, a checkpoint every
`--save-every` steps too (written to a temporary file, then renamed), and the Loader restored
right after it is built. Killed at any step, the port run again with `--resume` continues with
exactly the batches, and ends with exactly the weights, of a run that was never interrupted.

    python examples/imagenet/main_dataloader.py --epochs 2 --seed 0 --resume checkpoint.pth.tar
    python examples/imagenet/main.py --epochs 2 --seed 0 --save-every 20 --resume checkpoint.pth.tar
    torchrun --nproc_per_node 2 examples/imagenet/main.py --epochs 2 --seed 0 --save-every 20 \\
        --resume checkpoint.pth.tar
"""

import argparse
import os
import random
import shutil
import time
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Subset


class TinyNet(nn.Module):
    """A stand-in for torchvision's ResNets: conv, batch norm, pooling, a linear classifier."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


class SyntheticImages(torch.utils.data.Dataset):
    """A stand-in for ImageFolder: `size` 3x16x16 images of 10 classes, image i the same bytes
    on every read. Training images are flipped at random from torch's global RNG, as
    torchvision's RandomHorizontalFlip does."""

    def __init__(self, size, train, num_classes=10):
        self.size, self.train, self.num_classes = size, train, num_classes

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        target = index % self.num_classes
        generator = torch.Generator().manual_seed(2 * index + self.train)
        image = torch.rand(3, 16, 16, generator=generator) + target / self.num_classes
        if self.train and torch.rand(1) < 0.5:
            image = image.flip(-1)
        return image, target


models = {"tinynet": TinyNet}

parser = argparse.ArgumentParser(description="ImageNet-style training (tiny model, synthetic images)")
parser.add_argument("--train-size", default=1280, type=int, help="number of training images")
parser.add_argument("--val-size", default=500, type=int, help="number of validation images")
parser.add_argument("-a", "--arch", default="tinynet", choices=sorted(models), help="model architecture")
parser.add_argument("-j", "--workers", default=2, type=int, metavar="N", help="data loading workers")
parser.add_argument("--epochs", default=4, type=int, metavar="N", help="number of total epochs to run")
parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (useful on restarts)")
parser.add_argument("-b", "--batch-size", default=32, type=int, metavar="N", help="mini-batch size per process")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR", dest="lr")
parser.add_argument("--lr-step", default=30, type=int, metavar="N", help="divide the lr by 10 every N epochs")
parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W", dest="weight_decay")
parser.add_argument("-p", "--print-freq", default=10, type=int, metavar="N", help="print frequency")
parser.add_argument("--resume", default="", type=str, metavar="PATH", help="path to latest checkpoint")
parser.add_argument("-e", "--evaluate", dest="evaluate", action="store_true", help="evaluate only")
parser.add_argument("--world-size", default=-1, type=int, help="number of processes")
parser.add_argument("--rank", default=-1, type=int, help="rank of this process")
parser.add_argument("--dist-url", default="env://", type=str, help="url used to set up distributed training")
parser.add_argument("--dist-backend", default="gloo", type=str, help="distributed backend")
parser.add_argument("--seed", default=None, type=int, help="seed for initializing training")

best_acc1 = 0


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.distributed = args.world_size > 1
    main_worker(args)


def main_worker(args):
    global best_acc1
    if args.distributed:
        if args.dist_url == "env://" and args.rank == -1:
            args.rank = int(os.environ["RANK"])
        dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    device = torch.device("cpu")

    # create model
    print(f"=> creating model '{args.arch}'")
    model = models[args.arch]().to(device)
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)

    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    # optionally resume from a checkpoint
    if args.resume:
        if os.path.isfile(args.resume):
            print(f"=> loading checkpoint '{args.resume}'")
            checkpoint = torch.load(args.resume, map_location=device)
            args.start_epoch = checkpoint["epoch"]
            best_acc1 = checkpoint["best_acc1"]
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
        else:
            print(f"=> no checkpoint found at '{args.resume}'")

    # Data loading code
    train_dataset = SyntheticImages(args.train_size, train=True)
    val_dataset = SyntheticImages(args.val_size, train=False)

    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler = None
        val_sampler = None

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=True, sampler=train_sampler)

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=val_sampler)

    if args.evaluate:
        validate(val_loader, model, criterion, device, args)
        return

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, device, args)

        # evaluate on validation set
        acc1 = validate(val_loader, model, criterion, device, args)

        scheduler.step()

        # remember best acc@1 and save checkpoint
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)

        if not args.distributed or args.rank == 0:
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }, is_best)

    if args.distributed:
        dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    batch_time = AverageMeter("Time", ":6.3f")
    data_time = AverageMeter("Data", ":6.3f")
    losses = AverageMeter("Loss", ":.4e")
    top1 = AverageMeter("Acc@1", ":6.2f")
    top5 = AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(
        len(train_loader),
        [batch_time, data_time, losses, top1, top5],
        prefix=f"Epoch: [{epoch}]")

    # switch to train mode
    model.train()

    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        # measure data loading time
        data_time.update(time.time() - end)

        # move data to the same device as model
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        # compute output
        output = model(images)
        loss = criterion(output, target)

        # measure accuracy and record loss
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, device, args):

    def run_validate(loader, base_progress=0):
        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i
                images = images.to(device, non_blocking=True)
                target = target.to(device, non_blocking=True)

                # compute output
                output = model(images)
                loss = criterion(output, target)

                # measure accuracy and record loss
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0], images.size(0))
                top5.update(acc5[0], images.size(0))

                # measure elapsed time
                batch_time.update(time.time() - end)
                end = time.time()

                if i % args.print_freq == 0:
                    progress.display(i + 1)

    batch_time = AverageMeter("Time", ":6.3f", Summary.NONE)
    losses = AverageMeter("Loss", ":.4e", Summary.NONE)
    top1 = AverageMeter("Acc@1", ":6.2f", Summary.AVERAGE)
    top5 = AverageMeter("Acc@5", ":6.2f", Summary.AVERAGE)
    progress = ProgressMeter(
        len(val_loader) + (args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset))),
        [batch_time, losses, top1, top5],
        prefix="Test: ")

    # switch to evaluate mode
    model.eval()

    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
        top5.all_reduce()

    if args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset)):
        aux_val_dataset = Subset(val_loader.dataset,
                                 range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        aux_val_loader = torch.utils.data.DataLoader(
            aux_val_dataset, batch_size=args.batch_size, shuffle=False,
            num_workers=args.workers, pin_memory=True)
        run_validate(aux_val_loader, len(val_loader))

    progress.display_summary()

    return top1.avg


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter:
    """The latest value, running sum, count and mean of one measured quantity."""

    def __init__(self, name, fmt=":f", summary_type=Summary.AVERAGE):
        self.name, self.fmt, self.summary_type = name, fmt, summary_type
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):
        """Sum and count over every rank: each rank measured its own share of the samples."""
        total = torch.tensor([self.sum, self.count], dtype=torch.float32)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self):
        spec = self.fmt.lstrip(":")
        return f"{self.name} {self.val:{spec}} ({self.avg:{spec}})"

    def summary(self):
        values = {Summary.AVERAGE: self.avg, Summary.SUM: self.sum, Summary.COUNT: self.count}
        if self.summary_type not in values:
            return ""
        return f"{self.name} {values[self.summary_type]:.3f}"


class ProgressMeter:
    """Prints `prefix[batch/total]` and the meters, one line per call."""

    def __init__(self, num_batches, meters, prefix=""):
        self.total, self.meters, self.prefix = num_batches, meters, prefix

    def display(self, batch):
        width = len(str(self.total))
        entries = [f"{self.prefix}[{batch:{width}d}/{self.total}]"] + [str(m) for m in self.meters]
        print("\t".join(entries), flush=True)

    def display_summary(self):
        print(" ".join([" *"] + [m.summary() for m in self.meters if m.summary()]), flush=True)


def accuracy(output, target, topk=(1,)):
    """For each k in `topk`: the percentage of samples whose target is among the k highest scores."""
    with torch.no_grad():
        ranked = output.topk(max(topk), dim=1).indices
        hits = ranked == target.unsqueeze(1)
        return [hits[:, :k].any(dim=1).float().mean(0, keepdim=True) * 100 for k in topk]


if __name__ == "__main__":
    main()
