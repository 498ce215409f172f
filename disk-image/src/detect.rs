//! Format detection from an image's first bytes. Only qcow2 is read as a structured format; everything without a
//! known signature is raw. Formats qemu knows but we do not read are recognised by their signature so the user
//! is told what they uploaded instead of getting a "raw" disk full of container metadata.

/// Bytes of the file start that [`detect`] looks at.
pub(crate) const PROBE_LEN: usize = 4096;

/// What the first bytes say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Detected {
    Raw,
    Qcow2,
    /// A known image or container format that is not accepted, by its common name.
    Other(&'static str),
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 4)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

/// Detects the format from the first (up to [`PROBE_LEN`]) bytes of a file.
pub(crate) fn detect(head: &[u8]) -> Detected {
    let starts = |sig: &[u8]| head.starts_with(sig);
    if starts(b"QFI\xfb") {
        return match be32(head, 4) {
            Some(1) => Detected::Other("qcow (version 1)"),
            _ => Detected::Qcow2,
        };
    }
    if starts(b"KDMV") || starts(b"COWD") || head.windows(21).take(512).any(|w| w == b"# Disk DescriptorFile")
    {
        return Detected::Other("VMDK");
    }
    if head.len() >= 68 && head[64..68] == [0x7f, 0x10, 0xda, 0xbe] {
        return Detected::Other("VDI (VirtualBox)");
    }
    if starts(b"vhdxfile") {
        return Detected::Other("VHDX");
    }
    if starts(b"conectix") {
        return Detected::Other("VHD (vpc)");
    }
    if starts(b"LUKS\xba\xbe") {
        return Detected::Other("LUKS-encrypted");
    }
    if starts(b"QED\0") {
        return Detected::Other("QED");
    }
    if starts(b"WithoutFreeSpace") || starts(b"WithouFreSpacExt") {
        return Detected::Other("Parallels");
    }
    if starts(b"Bochs Virtual HD Image") {
        return Detected::Other("Bochs");
    }
    if starts(b"#!/bin/sh\n#V2.0 Format") {
        return Detected::Other("cloop");
    }
    // Compressed files: a raw disk never starts like this (boot code or zeros), a downloaded `.img.gz` does.
    if starts(&[0x1f, 0x8b]) {
        return Detected::Other("gzip-compressed");
    }
    if starts(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        return Detected::Other("xz-compressed");
    }
    if starts(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Detected::Other("zstd-compressed");
    }
    if starts(b"BZh") && head.get(3).is_some_and(|c| (b'1'..=b'9').contains(c)) {
        return Detected::Other("bzip2-compressed");
    }
    Detected::Raw
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_signatures_are_named() {
        assert_eq!(detect(b"QFI\xfb\0\0\0\x03rest"), Detected::Qcow2);
        assert_eq!(
            detect(b"QFI\xfb\0\0\0\x01rest"),
            Detected::Other("qcow (version 1)")
        );
        assert_eq!(detect(b"KDMV\x01\0\0\0"), Detected::Other("VMDK"));
        assert_eq!(detect(b"vhdxfile...."), Detected::Other("VHDX"));
        assert_eq!(detect(b"LUKS\xba\xbe\0\x02"), Detected::Other("LUKS-encrypted"));
        let mut vdi = vec![0u8; 128];
        vdi[64..68].copy_from_slice(&[0x7f, 0x10, 0xda, 0xbe]);
        assert_eq!(detect(&vdi), Detected::Other("VDI (VirtualBox)"));
        assert_eq!(detect(&[0u8; 512]), Detected::Raw);
        assert_eq!(detect(b""), Detected::Raw);
        assert_eq!(detect(b"QFI"), Detected::Raw);
    }
}
