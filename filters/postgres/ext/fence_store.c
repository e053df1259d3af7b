/*
 * What fencegate.enforce() and fencegate.guard(text) in C share (fence_store.h).
 *
 * Relations are read through the table and index access methods, not SPI: an SPI query costs
 * about 33k instructions per call in executor set-up alone (docs/BENCHMARKS.md). Everything is
 * looked up by schema and name (`fencegate`), never through the caller's search_path or pg_temp,
 * and no operator or function the caller could define is called.
 */
#include "postgres.h"

#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "executor/tuptable.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"

#include <openssl/evp.h>

#include "fence_store.h"

Oid
fencegate_relid(const char *name)
{
	Oid			relid = get_relname_relid(name, get_namespace_oid("fencegate", false));

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("fencegate: table fencegate.%s does not exist", name),
				 errhint("Run `fencegate postgres install` again.")));
	return relid;
}

AttrNumber
fencegate_column(Relation rel, const char *name)
{
	TupleDesc	desc = RelationGetDescr(rel);
	int			i;

	for (i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (!att->attisdropped && strcmp(NameStr(att->attname), name) == 0)
			return att->attnum;
	}
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_COLUMN),
			 errmsg("fencegate: column %s of fencegate.%s does not exist",
					name, RelationGetRelationName(rel)),
			 errhint("Run `fencegate postgres install` again.")));
	return InvalidAttrNumber;	/* not reached */
}

/*
 * With OpenSSL's EVP directly: the algorithm fetched and the contexts made once per backend, and
 * the digest states after each pad (one block each) kept for as long as the pads read are the
 * same. Through pg_cryptohash (a context per hash, OpenSSL 3 fetching the algorithm on every
 * init) the MAC cost about 18k instructions, half enforce()'s budget.
 */
void
fencegate_hmac(PadCache *cache, const bytea *ipad, const bytea *opad, const uint8 *m1,
			   size_t m1len, const uint8 *m2, size_t m2len, uint8 *out)
{
	static const EVP_MD *md = NULL;
	static EVP_MD_CTX *ctx = NULL;
	size_t		ilen = VARSIZE(ipad) - VARHDRSZ;
	size_t		olen = VARSIZE(opad) - VARHDRSZ;
	uint8		inner[PG_SHA256_DIGEST_LENGTH];
	unsigned int out_len = 0;

	if (md == NULL)
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
		md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
		md = EVP_sha256();
#endif
	if (ctx == NULL)
		ctx = EVP_MD_CTX_new();
	if (cache->after_ipad == NULL)
		cache->after_ipad = EVP_MD_CTX_new();
	if (cache->after_opad == NULL)
		cache->after_opad = EVP_MD_CTX_new();
	if (md == NULL || ctx == NULL || cache->after_ipad == NULL || cache->after_opad == NULL)
		ereport(ERROR, (errcode(ERRCODE_OUT_OF_MEMORY),
						errmsg("fencegate: OpenSSL has no SHA-256 context")));
	if (cache->pads == NULL || cache->ipad_len != ilen || cache->opad_len != olen
		|| memcmp(cache->pads, VARDATA(ipad), ilen) != 0
		|| memcmp(cache->pads + ilen, VARDATA(opad), olen) != 0)
	{
		char	   *both = MemoryContextAlloc(TopMemoryContext, ilen + olen + 1);

		/* Forget the old states first: an error below leaves none marked valid. */
		if (cache->pads != NULL)
			pfree(cache->pads);
		cache->pads = NULL;
		if (EVP_DigestInit_ex(cache->after_ipad, md, NULL) != 1
			|| EVP_DigestUpdate(cache->after_ipad, VARDATA(ipad), ilen) != 1
			|| EVP_DigestInit_ex(cache->after_opad, md, NULL) != 1
			|| EVP_DigestUpdate(cache->after_opad, VARDATA(opad), olen) != 1)
			elog(ERROR, "fencegate: could not compute SHA-256");
		memcpy(both, VARDATA(ipad), ilen);
		memcpy(both + ilen, VARDATA(opad), olen);
		cache->pads = both;
		cache->ipad_len = ilen;
		cache->opad_len = olen;
	}
	if (EVP_MD_CTX_copy_ex(ctx, cache->after_ipad) != 1
		|| EVP_DigestUpdate(ctx, m1, m1len) != 1
		|| EVP_DigestUpdate(ctx, m2, m2len) != 1
		|| EVP_DigestFinal_ex(ctx, inner, &out_len) != 1
		|| out_len != PG_SHA256_DIGEST_LENGTH
		|| EVP_MD_CTX_copy_ex(ctx, cache->after_opad) != 1
		|| EVP_DigestUpdate(ctx, inner, sizeof(inner)) != 1
		|| EVP_DigestFinal_ex(ctx, out, &out_len) != 1
		|| out_len != PG_SHA256_DIGEST_LENGTH)
		elog(ERROR, "fencegate: could not compute SHA-256");
}

void
fencegate_pass_mac(const char *held, size_t held_len, FullTransactionId fxid, Snapshot snap,
				   uint8 *out)
{
	static PadCache pass_pads;
	char		prefix[64];
	int			prefix_len;
	char	   *held_utf8;
	Relation	rel;
	TupleTableSlot *slot;
	TableScanDesc scan;
	AttrNumber	ipad_att;
	AttrNumber	opad_att;
	Datum		ipad_datum;
	Datum		opad_datum;
	bytea	   *ipad;
	bytea	   *opad;
	bool		isnull_i;
	bool		isnull_o;

	rel = table_open(fencegate_relid("pass_key"), AccessShareLock);
	ipad_att = fencegate_column(rel, "ipad");
	opad_att = fencegate_column(rel, "opad");
	slot = table_slot_create(rel, NULL);
	scan = table_beginscan(rel, snap, 0, NULL);
	if (!table_scan_getnextslot(scan, ForwardScanDirection, slot))
		ereport(ERROR,
				(errcode(ERRCODE_NO_DATA_FOUND),
				 errmsg("fencegate: fencegate.pass_key is empty"),
				 errhint("Run `fencegate postgres install` again.")));
	ipad_datum = slot_getattr(slot, ipad_att, &isnull_i);
	opad_datum = slot_getattr(slot, opad_att, &isnull_o);
	if (isnull_i || isnull_o)
		elog(ERROR, "fencegate: fencegate.pass_key has a NULL pad");
	/* Copies (detoasted), so the scan can end before hashing. */
	ipad = DatumGetByteaPCopy(ipad_datum);
	opad = DatumGetByteaPCopy(opad_datum);
	table_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	table_close(rel, NoLock);

	prefix_len = snprintf(prefix, sizeof(prefix), "pass2:%d:%llu:", MyProcPid,
						  (unsigned long long) U64FromFullTransactionId(fxid));
	/* As the plpgsql version: convert_to(message, 'UTF8'); no copy when the server is UTF8. */
	held_utf8 = pg_server_to_any(held, (int) held_len, PG_UTF8);
	if (held_utf8 != held)
		held_len = strlen(held_utf8);

	fencegate_hmac(&pass_pads, ipad, opad, (const uint8 *) prefix, prefix_len,
				   (const uint8 *) held_utf8, held_len, out);
}
